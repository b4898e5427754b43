# SPDX-License-Identifier: Apache-2.0
"""prefetch_on_lookup: reads start at the pinning lookup, the later get claims them.

Real StorageManager + plugin on real files. The lookup is LMCache's own
``StorageManager.batched_contains(keys, pin=True)`` (what the worker's lookup server runs for
the scheduler) and the release is ``batched_unpin`` (what ``lookup_unpin`` runs).
"""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvscope.patched_backend.parallel_disk import hooks
from kvscope.patched_backend.parallel_disk.config import from_extra_config
from kvscope.testkit.lmcache_harness import assert_exact, chunk_path, key

ON = {"kvscope.prefetch_on_lookup": True}  # the default, spelled out
CHUNK_BYTES = 512 << 10  # the test geometry: 2 x 4 layers x 256 tokens x 128 x bf16


def lookup(h, indices):
    hits, _ = h.manager.batched_contains([key(i) for i in indices], ["kvscope"], pin=True)
    return hits


def unpin(h, indices):
    h.manager.batched_unpin([key(i) for i in indices], ["kvscope"])


def allocated(h):
    """Bytes LMCache's CPU allocator has handed out and not got back."""
    return h.backend.local_cpu_backend.memory_allocator.pin_allocator.total_allocated_size


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def settled(h):
    """No read ahead pending, no memory held, no pin left by the backend."""
    stats = h.backend.stats()
    return (stats["prefetch_pending"] == 0 and stats["prefetch_held_bytes"] == 0
            and stats["reads_in_flight"] == 0)


def chunks(events, kind):
    """Chunks submitted for reading on the ``kind`` path (sync, async, prefetch)."""
    return sum(e.chunk_count for e in events["on_read_submit"] if e.path_kind == kind)


def test_off_lookup_reads_nothing(harness, events):
    h = harness(**{"kvscope.prefetch_on_lookup": False})
    h.put(list(range(4)))
    assert lookup(h, range(4)) == 4
    assert chunks(events, "prefetch") == 0 and h.backend.stats()["prefetch_reads"] == 0
    assert_exact(h.get(list(range(4))), list(range(4)))
    unpin(h, range(4))


def test_on_in_parallel_mode_off_in_serial_mode(tmp_path):
    base = {"kvscope.path": str(tmp_path), "kvscope.capacity": "1GiB"}
    assert from_extra_config(base).prefetch_on_lookup
    assert not from_extra_config({**base, "kvscope.mode": "serial"}).prefetch_on_lookup
    with pytest.raises(ValueError, match="kvscope.prefetch_on_lookup.*serial"):
        from_extra_config({**base, "kvscope.mode": "serial", "kvscope.prefetch_on_lookup": True})


def test_bit_exact_through_prefetch_without_a_second_read(harness, events):
    h = harness(**ON)
    h.put(list(range(8)))
    baseline = allocated(h)
    assert lookup(h, range(8)) == 8
    wait_for(lambda: h.backend.stats()["prefetch_reads"] == 8)
    assert_exact(h.get(list(range(8))), list(range(8)))
    unpin(h, range(8))
    stats = h.backend.stats()
    assert stats["prefetch_claimed"] == 8 and stats["read_hits"] == 8
    assert chunks(events, "prefetch") == 8 and chunks(events, "sync") == 0
    assert settled(h) and allocated(h) == baseline
    assert all(h.backend._index.get(key(i)).pins == 0 for i in range(8))


def test_each_claim_is_reported_to_the_request_that_took_it(harness, events):
    """The tracer gives a read ahead to the request whose get waited for it."""
    h = harness(**ON)
    h.put(list(range(6)))
    assert lookup(h, range(6)) == 6
    wait_for(lambda: h.backend.stats()["prefetch_reads"] == 6)
    (ahead,) = [e for e in events["on_read_submit"] if e.path_kind == "prefetch"]
    assert ahead.request_id is None  # submitted by the lookup, outside any request
    for request, indices in (("req-a", [0, 1, 2]), ("req-b", [3, 4, 5])):
        with hooks.request_context(request):
            assert_exact(h.get(indices), indices)
    unpin(h, range(6))
    assert [(c.request_id, c.keys) for c in events["on_read_claim"]] == [
        ("req-a", ahead.keys[:3]), ("req-b", ahead.keys[3:])]
    for claim in events["on_read_claim"]:
        assert claim.bytes == 3 * CHUNK_BYTES and claim.failed_keys == ()
        assert claim.submit_ns == ahead.submit_ns < claim.end_ns
        assert claim.submit_ns < claim.claim_ns and claim.reader_tids
    assert chunks(events, "sync") == 0


def test_claimed_and_unclaimed_memory_released(harness):
    h = harness(**ON)
    h.put(list(range(8)))
    baseline = allocated(h)
    assert lookup(h, range(8)) == 8
    wait_for(lambda: h.backend.stats()["prefetch_reads"] == 8)
    assert allocated(h) == baseline + 8 * CHUNK_BYTES
    assert_exact(h.get([0, 1, 2, 3]), [0, 1, 2, 3])  # claims half
    unpin(h, range(8))  # lookup_unpin: the other half is not wanted any more
    wait_for(lambda: settled(h))
    stats = h.backend.stats()
    assert stats["prefetch_claimed"] == 4 and stats["prefetch_unclaimed"] == 4
    assert allocated(h) == baseline
    assert all(h.backend._index.get(key(i)).pins == 0 for i in range(8))


def test_unclaimed_read_released_after_timeout(harness):
    h = harness(**ON, **{"kvscope.prefetch_timeout_s": 0.3})
    h.put([0, 1])
    baseline = allocated(h)
    assert lookup(h, [0, 1]) == 2
    wait_for(lambda: h.backend.stats()["prefetch_unclaimed"] == 2)
    assert settled(h) and allocated(h) == baseline
    # only LMCache's own lookup pin is left, for its unpin to release
    assert [h.backend._index.get(key(i)).pins for i in (0, 1)] == [1, 1]
    assert_exact(h.get([0, 1]), [0, 1])  # read again, still exact
    unpin(h, [0, 1])


def test_corrupt_prefetched_chunk_is_a_miss(harness, events):
    h = harness(**ON)
    h.put(list(range(4)))
    with open(chunk_path(h.backend.path, 2), "r+b") as f:
        f.seek(4096 + 1000)
        byte = f.read(1)
        f.seek(4096 + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert lookup(h, range(4)) == 4
    wait_for(lambda: h.backend.stats()["prefetch_reads"] == 4)
    objs = h.get(list(range(4)))
    assert objs[2] is None and objs[3] is None
    assert_exact(objs[:2], [0, 1])
    unpin(h, range(4))
    (claim,) = events["on_read_claim"]
    assert claim.failed_keys == (claim.keys[2],) and claim.bytes == 3 * CHUNK_BYTES
    wait_for(lambda: settled(h))
    assert h.backend.stats()["corrupt_by_reason"] == {"checksum": 1}
    assert os.path.exists(chunk_path(h.backend.path, 2) + ".corrupt")


def test_removed_while_prefetching_is_a_miss(harness):
    h = harness(**ON, **{"kvscope.read_delay_ms": 200})
    h.put([0, 1, 2])
    baseline = allocated(h)
    assert lookup(h, [0, 1, 2]) == 3
    assert h.manager.remove(key(1), ["kvscope"])  # reads still in flight (200 ms delay)
    objs = h.get([0, 1, 2])
    assert objs[1] is None and objs[2] is None
    assert_exact(objs[:1], [0])
    unpin(h, [0, 1, 2])
    wait_for(lambda: settled(h))
    assert allocated(h) == baseline


def test_replaced_while_prefetching_is_read_again(harness, events):
    h = harness(**ON, **{"kvscope.read_delay_ms": 200})
    h.put([0, 1])
    assert lookup(h, [0, 1]) == 2
    old = h.backend._index.get(key(1))
    # dropped from the index behind the backend's back (as when another get refuses the file)
    # and stored again: a new file and index entry while the read ahead is in flight
    assert h.backend._index.remove(key(1)) is old
    h.put([1])
    assert h.backend._index.get(key(1)) is not old
    assert_exact(h.get([0, 1]), [0, 1])
    unpin(h, [0, 1])
    wait_for(lambda: settled(h))
    assert chunks(events, "sync") == 1  # the stale read ahead was not served
    assert h.backend.stats()["prefetch_unclaimed"] == 1


def test_no_memory_no_prefetch(harness):
    h = harness(**ON)
    h.put([0, 1])
    hog = []
    shape = torch.Size([2, 4, 256, 128])  # one chunk of the test geometry
    while (obj := h.backend.local_cpu_backend.allocate(
            shape, torch.bfloat16, busy_loop=False)) is not None:
        hog.append(obj)
    assert lookup(h, [0, 1]) == 2
    assert h.backend.stats()["prefetch_reads"] == 0 and h.backend.stats()["prefetch_pending"] == 0
    for obj in hog:
        obj.ref_count_down()
    assert_exact(h.get([0, 1]), [0, 1])
    unpin(h, [0, 1])


def test_budget_bounds_memory_and_backlog_follows_claims(harness):
    h = harness(**ON, **{"kvscope.prefetch_bytes": 4 * CHUNK_BYTES})
    h.put(list(range(12)))
    baseline = allocated(h)
    assert lookup(h, range(12)) == 12
    wait_for(lambda: h.backend.stats()["prefetch_reads"] == 4)
    assert h.backend.stats()["prefetch_held_bytes"] == 4 * CHUNK_BYTES
    assert allocated(h) == baseline + 4 * CHUNK_BYTES
    for start in (0, 4, 8):
        wanted = list(range(start, start + 4))
        assert_exact(h.get(wanted), wanted)
    unpin(h, range(12))
    wait_for(lambda: settled(h))
    assert h.backend.stats()["prefetch_claimed"] == 12 and allocated(h) == baseline


@pytest.mark.timeout(180)
def test_64_concurrent_lookups_and_gets_no_deadlock(harness):
    h = harness(**ON, **{"kvscope.prefetch_bytes": 8 * CHUNK_BYTES,
                         "kvscope.read_unit": "64KiB", "kvscope.queue_depth": 8})
    h.put(list(range(16)))
    baseline = allocated(h)

    def one(n):
        wanted = [(n + j) % 16 for j in range(1 + n % 5)]  # overlapping keys across requests
        assert lookup(h, wanted) == len(wanted)
        assert_exact(h.get(wanted), wanted)
        unpin(h, wanted)

    with ThreadPoolExecutor(max_workers=64) as pool:
        list(pool.map(one, range(64)))
    wait_for(lambda: settled(h))
    assert allocated(h) == baseline
    assert all(h.backend._index.get(key(i)).pins == 0 for i in range(16))


def test_close_returns_unclaimed_memory(harness):
    h = harness(**ON, **{"kvscope.read_delay_ms": 100})
    h.put(list(range(4)))
    baseline = allocated(h)
    assert lookup(h, range(4)) == 4
    h.backend.close()  # reads in flight, none claimed
    assert allocated(h) == baseline and settled(h)
    assert lookup(h, range(4)) == 4  # after close: no read ahead
    assert h.backend.stats()["prefetch_pending"] == 0


@pytest.mark.parametrize("name, value", [("prefetch_on_lookup", "maybe"),
                                         ("prefetch_bytes", "lots"),
                                         ("prefetch_timeout_s", 0)])
def test_bad_prefetch_knob_names_the_key(name, value, tmp_path):
    extra = {"kvscope.path": str(tmp_path), "kvscope.capacity": "1GiB", f"kvscope.{name}": value}
    with pytest.raises(ValueError, match=f"kvscope.{name}"):
        from_extra_config(extra)
