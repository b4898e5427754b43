"""Dashboard fixtures: synthetic run directories and headless Debian Chromium for dash_duo."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from kvscope.dashboards.browser import CHROMIUM, chromium_options

HAVE_BROWSER = Path(CHROMIUM).exists() and shutil.which("chromedriver") is not None


def pytest_setup_options():
    """dash[testing] hook: drive Debian's Chromium headless (scripts/setup.d/chromium.sh)."""
    return chromium_options()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if HAVE_BROWSER:
        return
    skip = pytest.mark.skip(reason=f"{CHROMIUM} or chromedriver missing: run scripts/setup.sh")
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(7)


@pytest.fixture(scope="session")
def synthetic_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two small synthetic runs (different seeds): stand-ins for serial and parallel."""
    from kvscope.testkit import synthetic

    root = tmp_path_factory.mktemp("runs")
    return (synthetic.make_run(root / "serial", n_requests=24, seed=1, concurrency=1,
                               phases=("warm", "cold"), ledger=True),
            synthetic.make_run(root / "parallel", n_requests=24, seed=2, concurrency=4,
                               nvme=True, ledger=True))


@pytest.fixture(scope="session")
def loaded(synthetic_runs: tuple[Path, Path]) -> dict:
    from kvscope.dashboards import data

    return data.load_runs(synthetic_runs)
