"""Every room type-checks: mypy over the `kvscope` package, with the settings in pyproject.toml.

Type hints that nothing checks drift from the code; this keeps them a checked contract. The
serving stack's own packages are skipped there (each exception says why), so a finding here is
about kvscope's code.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_error_in_any_room():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
