# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the backend tests (helpers live in kvscope.testkit.lmcache_harness)."""

# Standard
from collections import defaultdict
from typing import Any, Callable, Iterator
import random

# Third Party
import pytest
import torch

# First Party
from kvscope.testkit.lmcache_harness import Harness
from kvscope.patched_backend.parallel_disk import hooks


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


class _Recorder:
    """A listener that keeps every event it is sent, by method name (``on_read_submit``...)."""

    def __init__(self) -> None:
        self.by_kind: defaultdict[str, list[Any]] = defaultdict(list)

    def __getattr__(self, name: str) -> Callable[[Any], None]:
        if not name.startswith("on_"):
            raise AttributeError(name)
        return self.by_kind[name].append


@pytest.fixture
def events() -> Iterator[defaultdict[str, list[Any]]]:
    """Every hook event of the test, by method name."""
    recorder = _Recorder()
    hooks.add_listener(recorder)
    yield recorder.by_kind
    hooks.remove_listener(recorder)
