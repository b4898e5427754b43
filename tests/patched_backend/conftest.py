# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the backend tests (helpers live in kvscope.testkit.lmcache_harness)."""

import random
from collections import defaultdict
from typing import Any, Callable, Iterator

import pytest
import torch

from kvscope.patched_backend.parallel_disk import hooks, layout
from kvscope.testkit.lmcache_harness import Harness, copy_connector, lmcache_config
from kvscope.testkit.tracing import RecordedSpans
from kvscope.tracer import runtime
from kvscope.tracer.spans import RequestTrace
from kvscope.tracer.storage import ParallelReadListener


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_writer_left_registered() -> Iterator[None]:
    """The KV layout's writer is per process (the CPU connector registers its own): one test
    file's connector must not make the next file's chunks, written by a child process with
    LMCache's layout, look foreign (their scan refused every chunk as `layout`)."""
    yield
    layout.register_writer(None)


def _bare(inner: Any, config: Any, meta: Any) -> Any:
    return inner


@pytest.fixture
def lmcache_engines(tmp_path: Any) -> Iterator[Callable[..., tuple[Any, Any]]]:
    """``make(meta, wrap, **knobs)``: a real LMCacheEngine of ``meta`` on ``tmp_path/kv``, its
    connector the copy connector as ``wrap(inner, config, meta)`` returns it; (engine,
    connector). One engine at a time: it holds the directory's lock."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    names: list[str] = []

    def make(meta: Any, wrap: Callable[[Any, Any, Any], Any] = _bare,
             **knobs: Any) -> tuple[Any, Any]:
        if names:
            LMCacheEngineBuilder.destroy(names.pop())
        config = lmcache_config(str(tmp_path / "kv"), **knobs)
        connector = wrap(copy_connector(meta.kv_shape), config, meta)
        name = f"kvscope-engine-{len(names)}-{random.getrandbits(32):08x}"
        engine = LMCacheEngineBuilder.get_or_create(
            name, config, meta, connector, lambda tensor, src: None, lambda obj, src: obj)
        engine.post_init()
        names.append(name)
        return engine, connector

    yield make
    for name in names:
        LMCacheEngineBuilder.destroy(name)


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


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordedSpans]:
    """Finished spans of this process's tracer (the real listener, tracer/storage.py), read
    from its rings in this process instead of an exporter's; span times are monotonic ns
    (clock offset 0)."""
    recorded = RecordedSpans()
    monkeypatch.setattr(runtime, "get", lambda *a, **k: recorded.runtime)
    listener = ParallelReadListener()
    hooks.add_listener(listener)
    yield recorded
    hooks.remove_listener(listener)


@pytest.fixture
def traced_request() -> Callable[[int], RequestTrace]:
    """`traced_request(i)`: the trace of request `req-i`, as the worker tracer holds it."""
    def make(i: int) -> RequestTrace:
        return RequestTrace(0x1000 + i, 0x2000 + i, f"req-{i}", f"cmpl-req-{i}-0-abcd")

    return make
