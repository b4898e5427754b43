# SPDX-License-Identifier: Apache-2.0
"""Issue 14 item 6: a failed write never leaks its reservation; the write queue is bounded.

Real StorageManager + plugin on real files.
"""

import threading

import torch

from kvscope.patched_backend.parallel_disk.chunkfile import file_size_for
from kvscope.testkit.lmcache_harness import MODEL, assert_exact, key, kv_tensor

CHUNK_BYTES = 512 << 10  # the test geometry: 2 x 4 layers x 256 tokens x 128 x bf16
FILE = file_size_for(CHUNK_BYTES)


def _long_key(i: int):
    """A key whose metadata cannot fit the 4 KiB header (a 5000-character model name)."""
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(MODEL + "-" + "x" * 5000, 1, 0, 0x2000 + i, torch.bfloat16)


def _put(h, keys, seeds):
    objs = []
    for seed in seeds:
        data = kv_tensor(seed)
        obj = h.manager.allocate(data.shape, data.dtype)
        obj.tensor.copy_(data)
        objs.append(obj)
    h.manager.batched_put(keys, objs, location="kvscope")


def test_metadata_too_large_for_the_header_returns_its_reservation(harness):
    h = harness(**{"kvscope.capacity": 4 * FILE})  # room for exactly four chunk files
    _put(h, [_long_key(i) for i in range(4)], range(4))
    assert h.backend.flush(timeout=60)
    stats = h.backend.stats()
    assert stats["store_failures"] == 4 and stats["stores"] == 0
    h.put([0, 1, 2, 3])  # the full capacity is still there
    stats = h.backend.stats()
    assert stats["stores"] == 4 and stats["stores_skipped"] == 0, stats
    assert_exact(h.get([0, 1, 2, 3]), [0, 1, 2, 3])


class _HoldFirstStore:
    """Listener that keeps the (single) writer thread inside the first store's event."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def on_store(self, event) -> None:
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(60)


def test_full_write_queue_drops_stores_and_counts_them(harness):
    from kvscope.patched_backend.parallel_disk import hooks

    h = harness(**{"kvscope.write_queue_bytes": 2 * CHUNK_BYTES})
    hold = _HoldFirstStore()
    hooks.add_listener(hold)
    dropped = []

    class Dropped:
        def on_store(self, event) -> None:
            if event.reason == "queue_full":
                dropped.append(event)

    dropped_listener = Dropped()
    hooks.add_listener(dropped_listener)
    try:
        h.put([0], flush=False)
        assert hold.entered.wait(60)  # the writer is busy: later stores queue
        h.put(list(range(1, 10)), flush=False)
        stats = h.backend.stats()
        assert stats["write_queued_bytes"] == 2 * CHUNK_BYTES
        assert stats["stores_dropped"] == 7
        assert len(dropped) == 7 and not any(e.ok for e in dropped)  # each drop is an event
        assert all(e.writer_tid == -1 and e.error.startswith("write queue full")
                   for e in dropped)
    finally:
        hold.release.set()
        hooks.remove_listener(hold)
        hooks.remove_listener(dropped_listener)
    assert h.backend.flush(timeout=60)
    stats = h.backend.stats()
    assert stats["stores"] == 3 and stats["write_queued_bytes"] == 0
    assert_exact(h.get([0, 1, 2]), [0, 1, 2])
    assert h.get([3]) == [None]
    assert not h.backend.contains(key(3))
