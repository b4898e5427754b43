# SPDX-License-Identifier: Apache-2.0
"""Concurrent requests: no deadlock, every KV exact; async prefetches overlap their reads."""

# Standard
from concurrent.futures import ThreadPoolExecutor
import asyncio

# Third Party
import pytest

# First Party
from backend_support import assert_exact, key
from patched_backend.parallel_disk import hooks

MODES = [
    pytest.param({"kvscope.read_unit": "64KiB", "kvscope.queue_depth": 8}, id="parallel"),
    pytest.param({"kvscope.mode": "serial"}, id="serial"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("knobs", MODES)
def test_64_concurrent_batched_gets_are_exact(harness, knobs):
    h = harness(**knobs)
    h.put(list(range(16)))

    def one(n):
        wanted = [(n + j) % 16 for j in range(1 + n % 5)]
        assert_exact(h.get(wanted), wanted)
        return len(wanted)

    with ThreadPoolExecutor(max_workers=64) as pool:
        served = sum(pool.map(one, range(64)))
    assert h.backend.stats()["read_hits"] == served
    assert h.backend.stats()["reads_in_flight"] == 0


class _Recorder:
    def __init__(self):
        self.submits, self.completes = [], []

    def on_read_submit(self, event):
        self.submits.append(event)

    def on_read_complete(self, event):
        self.completes.append(event)


def test_async_prefetches_through_lmcache_serializer_overlap(harness):
    """StorageManager's AsyncSingleSerializer lock serialises only the waiting, not the reads."""
    h = harness(enable_async_loading=True, **{"kvscope.read_delay_ms": 300})
    h.put(list(range(8)))
    recorder = _Recorder()
    hooks.add_listener(recorder)
    try:
        results = asyncio.run_coroutine_threadsafe(_prefetch_all(h), h.manager.loop).result(60)
    finally:
        hooks.remove_listener(recorder)
    for i, objs in enumerate(results):
        assert len(objs) == 1
        objs[0].unpin()
        assert_exact(objs, [i])
    assert len(recorder.submits) == 8 and len(recorder.completes) == 8
    assert {e.request_id for e in recorder.submits} == {f"lookup-{i}" for i in range(8)}
    # every batch was submitted before the first one finished its 300 ms read
    assert max(e.submit_ns for e in recorder.submits) < min(c.end_ns for c in recorder.completes)


async def _prefetch_all(h):
    backend, serializer = h.backend, h.manager.async_serializer
    assert serializer is not None, "enable_async_loading did not create LMCache's serializer"
    tasks = [
        asyncio.create_task(serializer.run(backend.batched_get_non_blocking(f"lookup-{i}", [key(i)]), 1))
        for i in range(8)
    ]
    return await asyncio.gather(*tasks)
