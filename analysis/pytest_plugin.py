"""pytest plugin for the TTFT gate: one test per baseline component.

    pytest -p kvscope.analysis.pytest_plugin --kvscope-run RUN baseline.json [--junitxml out.xml]

The baseline file given on the command line is collected as a test file whose items are its
components; each fails with the same message as `kvscope check`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvscope.analysis import gate, outputs


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kvscope-run", metavar="RUN", help="run directory to gate against the "
                     "baseline JSON file(s) given as test paths")


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    run = parent.config.getoption("--kvscope-run")
    if run and file_path.suffix == ".json" and parent.session.isinitpath(file_path):
        return BaselineFile.from_parent(parent, path=file_path)
    return None


class BaselineFile(pytest.File):
    """A baseline JSON file: one ComponentItem per component."""

    def collect(self) -> Any:
        baseline = gate.read_baseline(self.path)
        run = self.config.getoption("--kvscope-run")
        result = gate.check(outputs.load_attribution(run), baseline)
        for r in result.itertuples():
            yield ComponentItem.from_parent(self, name=r.component, row=r)


class ComponentItem(pytest.Item):
    def __init__(self, *, row: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.row = row

    def runtest(self) -> None:
        if self.row.status != "ok":
            raise RegressionError(gate.failure_message(self.row))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        return str(excinfo.value)

    def reportinfo(self) -> tuple[Path, None, str]:
        return self.path, None, f"ttft gate: {self.name}"


class RegressionError(AssertionError):
    """A component above its baseline limit."""
