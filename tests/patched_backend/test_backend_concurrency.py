# SPDX-License-Identifier: Apache-2.0
"""Concurrent requests: no deadlock, every KV exact; async prefetches overlap their reads."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvscope.testkit.lmcache_harness import assert_exact, key

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


def test_async_prefetches_through_lmcache_serializer_overlap(harness, events):
    """StorageManager's AsyncSingleSerializer lock serialises only the waiting, not the reads."""
    h = harness(enable_async_loading=True, **{"kvscope.read_delay_ms": 300})
    h.put(list(range(8)))
    results = asyncio.run_coroutine_threadsafe(_prefetch_all(h), h.manager.loop).result(60)
    for i, objs in enumerate(results):
        assert len(objs) == 1
        objs[0].unpin()
        assert_exact(objs, [i])
    submits, completes = events["on_read_submit"], events["on_read_complete"]
    assert len(submits) == 8 and len(completes) == 8
    assert {e.request_id for e in submits} == {f"lookup-{i}" for i in range(8)}
    # every batch was submitted before the first one finished its 300 ms read
    assert max(e.submit_ns for e in submits) < min(c.end_ns for c in completes)


async def _prefetch_all(h):
    backend, serializer = h.backend, h.manager.async_serializer
    assert serializer is not None, "enable_async_loading did not create LMCache's serializer"
    tasks = [
        asyncio.create_task(serializer.run(backend.batched_get_non_blocking(f"lookup-{i}", [key(i)]), 1))
        for i in range(8)
    ]
    return await asyncio.gather(*tasks)
