"""`kvscope --help` builds every subcommand's parser without the heavy stack behind them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize(("argv", "said"), [
    pytest.param(["demo", "--repeats", "0"], "argument --repeats: must be at least 1, got 0",
                 id="no-repetition"),
    pytest.param(["demo", "--repeats", "two"], "argument --repeats: invalid _positive value",
                 id="not-a-number"),
    pytest.param(["demo", "--order", "latin"], "argument --order: invalid choice: 'latin'",
                 id="unknown-order"),
])
def test_a_study_without_a_repetition_or_with_an_unknown_order_is_refused_before_any_work(
        argv, said, capsys):
    from kvscope.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and said in err and "Traceback" not in err


def test_the_regression_gate_takes_one_run_and_says_so(tmp_path, capsys):
    from kvscope.cli import main

    assert main(["check", str(tmp_path), str(tmp_path), "--baseline", "b.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RUN --baseline FILE (regression gate)" in err
