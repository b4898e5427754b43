"""Shared fixtures for the analysis tests: synthetic runs on disk and small in-memory runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.testkit import synthetic


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 200-request, two-phase synthetic run (read-only: tests that edit it copy it)."""
    return synthetic.make_run(tmp_path_factory.mktemp("synthetic") / "run", n_requests=200,
                              seed=7, concurrency=4, phases=("warm", "cold"), nvme=True)
