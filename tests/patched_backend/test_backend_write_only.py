# SPDX-License-Identifier: Apache-2.0
"""A write-only kvscope tier beside LMCache's stock disk tier (the study's shared warm phase):
every put lands in both formats, every lookup and read is the stock tier's, and a later
server on the kvscope directory finds and reads every chunk. Real StorageManager, real files."""

import time

import pytest

from kvscope.testkit.lmcache_harness import assert_exact, key

CHUNKS = [0, 1, 2]


def _stock_holds_all(h, keys, timeout_s: float = 30.0) -> tuple[int, dict]:
    """The stock tier indexes a chunk once its (asynchronous) write is done."""
    deadline = time.monotonic() + timeout_s
    while True:
        hits, where = h.manager.batched_contains(keys)
        if hits == len(keys) or time.monotonic() > deadline:
            return hits, where
        time.sleep(0.05)


def test_write_only_tier_stores_beside_stock_and_serves_nothing(harness, tmp_path):
    stock_dir, copy_dir = tmp_path / "stock", tmp_path / "copy"
    stock_dir.mkdir()
    h = harness(copy_dir, local_disk=f"file://{stock_dir}", max_local_disk_size=1,
                **{"kvscope.write_only": True, "kvscope.mode": "serial"})
    assert list(h.manager.storage_backends)[-1] == "kvscope"  # after the stock tier
    h.put(CHUNKS, location=None)  # as LMCache's store: every backend
    assert h.backend.stats()["stores"] == len(CHUNKS)
    keys = [key(i) for i in CHUNKS]
    assert h.backend.batched_contains(keys, pin=True) == 0 and not h.backend.contains(keys[0])
    hits, where = _stock_holds_all(h, keys)
    assert hits == len(CHUNKS) and list(where) == ["LocalDiskBackend"]
    assert_exact(h.manager.batched_get(keys, location="LocalDiskBackend"), CHUNKS)
    h.close()

    later = harness(copy_dir, **{"kvscope.mode": "serial"})  # a new server, kvscope alone
    assert later.backend.batched_contains(keys) == len(CHUNKS)
    assert_exact(later.get(CHUNKS), CHUNKS)


def test_a_write_only_tier_reads_nothing_ahead():
    from kvscope.patched_backend.parallel_disk.config import from_extra_config

    on = {"kvscope.path": "/x", "kvscope.capacity": "1GiB", "kvscope.write_only": True}
    assert from_extra_config(on).prefetch_on_lookup is False  # even in parallel mode
    with pytest.raises(ValueError, match="write_only tier serves no lookups"):
        from_extra_config({**on, "kvscope.prefetch_on_lookup": True})
