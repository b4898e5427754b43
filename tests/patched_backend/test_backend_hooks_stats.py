# SPDX-License-Identifier: Apache-2.0
"""Listener hooks, stats, LRU eviction under the capacity limit, knob validation."""

import re
import threading
import time

import pytest

from kvscope.patched_backend.parallel_disk import hooks
from kvscope.patched_backend.parallel_disk.chunkfile import file_size_for
from kvscope.patched_backend.parallel_disk.config import DELAY_ENV, from_extra_config, parse_size
from kvscope.testkit.lmcache_harness import assert_exact, key

CHUNK_BYTES = 2 * 4 * 256 * 128 * 2  # the test geometry's payload


class _Broken:
    def on_read_submit(self, event):
        raise RuntimeError("listener bug")


@pytest.fixture
def broken():
    listener = _Broken()
    hooks.add_listener(listener)
    yield listener
    hooks.remove_listener(listener)


def test_listeners_see_reads_and_stores_and_a_broken_one_changes_nothing(harness, broken,
                                                                         events):
    h = harness(**{"kvscope.read_unit": "128KiB", "kvscope.queue_depth": 4})
    h.put([0, 1, 2])
    with hooks.request_context("req-42"):
        assert_exact(h.get([0, 1, 2]), [0, 1, 2])
    [submit] = events["on_read_submit"]
    [done] = events["on_read_complete"]
    assert submit.request_id == "req-42" and submit.path_kind == "sync"
    assert submit.chunk_count == 3 and submit.bytes == 3 * CHUNK_BYTES
    assert submit.sub_reads == 3 * (CHUNK_BYTES // (128 << 10))
    assert done.submit is submit and done.ok_chunks == 3 and not done.failed_keys
    assert submit.submit_ns <= done.first_chunk_ready_ns <= done.end_ns
    assert done.reader_tids and threading.get_native_id() not in done.reader_tids
    assert [e.ok for e in events["on_store"]] == [True] * 3
    assert all(e.bytes == file_size_for(CHUNK_BYTES) for e in events["on_store"])
    assert hooks.live_backends() and h.backend in hooks.live_backends()


def test_lru_eviction_keeps_capacity_and_recent_chunks(harness, events):
    h = harness(**{"kvscope.capacity": 3 * file_size_for(CHUNK_BYTES)})
    h.put([0, 1, 2])
    assert_exact(h.get([0]), [0])  # 0 becomes most recently used
    h.put([3])
    assert [h.backend.contains(key(i)) for i in range(4)] == [True, False, True, True]
    stats = h.backend.stats()
    assert stats["evictions"] == 1 and stats["used_bytes"] <= stats["capacity_bytes"]
    assert [e.key for e in events["on_evict"]] == [key(1).to_string()]
    evict = events["on_evict"][0]
    assert evict.capacity_bytes == 3 * file_size_for(CHUNK_BYTES) and evict.at_ns > 0
    assert [h.backend.has_chunk(key(i)) for i in range(4)] == [True, False, True, True]


def test_pinned_chunks_are_not_evicted(harness):
    h = harness(**{"kvscope.capacity": 2 * file_size_for(CHUNK_BYTES)})
    h.put([0, 1])
    assert h.backend.contains(key(0), pin=True) and h.backend.contains(key(1), pin=True)
    h.put([2])
    assert h.backend.stats()["stores_skipped"] == 1 and not h.backend.contains(key(2))
    h.backend.unpin(key(0))
    # the lookups also started reads ahead, which hold their own pin until the read is done
    deadline = time.monotonic() + 20
    while h.backend._index.get(key(0)).pins:
        assert time.monotonic() < deadline, "the read ahead of an unpinned chunk kept its pin"
        time.sleep(0.01)
    h.put([2])
    assert h.backend.contains(key(2)) and not h.backend.contains(key(0))


@pytest.mark.parametrize(("extra", "message"), [
    pytest.param({}, "kvscope.path is not set", id="no-path"),
    pytest.param({"kvscope.path": "/x"}, "kvscope.capacity is not set", id="no-capacity"),
    pytest.param({"kvscope.path": "/x", "kvscope.capacity": "lots"}, "kvscope.capacity: 'lots'",
                 id="bad-size"),
    pytest.param({"kvscope.path": "/x", "kvscope.capacity": "1GB", "kvscope.mode": "fast"},
                 "kvscope.mode: 'fast'", id="bad-mode"),
    pytest.param({"kvscope.path": "/x", "kvscope.capacity": "1GB", "kvscope.read_unit": 1000},
                 "multiple of 4096", id="unaligned-read-unit"),
    pytest.param({"kvscope.path": "/x", "kvscope.capacity": "1GB", "kvscope.queue_depth": "x"},
                 "kvscope.queue_depth: 'x' is not an integer", id="bad-depth"),
    # Non-finite and out-of-range numbers (inf timeouts raised OverflowError into LMCache on
    # every get, leaving pins behind; nan made every read a silent timeout miss).
    *[pytest.param({"kvscope.path": "/x", "kvscope.capacity": "1GB", f"kvscope.{key}": value},
                   f"kvscope.{key}: {value!r} is not",
                   id=f"{key}-{type(value).__name__}-{value}")
      for key in ("read_timeout_s", "prefetch_timeout_s", "read_delay_ms")
      for value in (float("inf"), float("nan"), "inf", "nan")],
    pytest.param({"kvscope.path": "/x", "kvscope.capacity": "1GB", "kvscope.read_timeout_s": 1e9},
                 "kvscope.read_timeout_s: 1000000000.0 is out of range", id="timeout-huge"),
    pytest.param({"kvscope.path": "/x", "kvscope.capacity": float("inf")},
                 "kvscope.capacity: inf is not a size", id="capacity-inf"),
    pytest.param({"kvscope.path": "/x", "kvscope.capacity": "1GB", "kvscope.queue_depth": 2.5},
                 "kvscope.queue_depth: 2.5 is not an integer", id="depth-fraction"),
    pytest.param({"kvscope.path": "/x", "kvscope.capacity": "1GB",
                  "kvscope.write_threads": 10**9}, "kvscope.write_threads: 1000000000 is out of "
                 "range; use a value from 1 to 256", id="threads-huge"),
])
def test_bad_knobs_name_the_key(extra, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        from_extra_config(extra)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "soon", "1e9"])
def test_a_bad_read_delay_from_the_environment_is_named(value, monkeypatch):
    monkeypatch.setenv(DELAY_ENV, value)
    with pytest.raises(ValueError, match=f"^{DELAY_ENV}: "):
        from_extra_config({"kvscope.path": "/x", "kvscope.capacity": "1GB"})
    chosen = {"kvscope.path": "/x", "kvscope.capacity": "1GB", "kvscope.read_delay_ms": 2}
    assert from_extra_config(chosen).read_delay_ms == 2.0  # extra_config wins, env unread


def test_sizes_and_serial_mode():
    assert parse_size("k", "4MiB") == 4 << 20 and parse_size("k", "20GB") == 20 * 10**9
    cfg = from_extra_config({"kvscope.path": "/x", "kvscope.mode": "serial"}, 2.0)
    assert cfg.capacity == 2 << 30
    # serial reads as the seeds' serial path did: 128 KiB at a time, one in flight
    assert cfg.effective_queue_depth == 1 and cfg.read_unit == 128 << 10
    assert from_extra_config({"kvscope.path": "/x"}, 2.0).read_unit == 4 << 20  # parallel


@pytest.mark.parametrize(("knobs", "reads_per_chunk"), [
    pytest.param({}, CHUNK_BYTES // (128 << 10), id="default-128KiB"),
    pytest.param({"kvscope.read_unit": "4MiB"}, 1, id="one-read-per-chunk"),
])
def test_serial_mode_reads_chunk_after_chunk_in_read_unit_pieces_from_one_reader(
        harness, events, knobs, reads_per_chunk):
    h = harness(**{"kvscope.mode": "serial", **knobs})
    h.put([0, 1, 2])
    assert_exact(h.get([0, 1, 2]), [0, 1, 2])
    [submit] = events["on_read_submit"]
    [done] = events["on_read_complete"]
    assert submit.mode == "serial" and submit.sub_reads == 3 * reads_per_chunk
    assert len(done.reader_tids) == 1  # one reader: one read in flight, each waited for
    ready = [chunk.ready_ns for chunk in done.chunks]
    assert ready == sorted(ready) and done.ok_chunks == 3  # chunks in turn, all verified
    assert h.backend.stats()["queue_depth"] == 1
