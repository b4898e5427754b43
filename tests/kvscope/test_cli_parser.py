"""`kvscope --help` builds every subcommand's parser without the heavy stack behind them."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("pandas", "pyarrow", "aiohttp", "numpy", "torch", "vllm", "lmcache", "dash", "bcc")


def test_building_the_parser_imports_no_heavy_package():
    probe = ("import json, sys; from kvscope import cli; cli.build_parser(); "
             f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout) == []


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "kvscope.cli", "--help"], capture_output=True,
                         text=True, check=True)
    assert all(name in out.stdout for name in ("analyze", "demo", "import", "record", "run"))
