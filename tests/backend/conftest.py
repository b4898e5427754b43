# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the backend tests (helpers live in backend_support.py)."""

# Standard
from typing import Any, Callable, Iterator
import random

# Third Party
import pytest
import torch

# First Party
from backend_support import Harness


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def harness(tmp_path: Any) -> Iterator[Callable[..., Harness]]:
    """Factory of harnesses on ``tmp_path/kv``, all closed at teardown."""
    made: list[Harness] = []

    def make(path: Any = None, **knobs: Any) -> Harness:
        h = Harness(str(path or tmp_path / "kv"), **knobs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
