# SPDX-License-Identifier: Apache-2.0
"""Issue 14 item 4: every read ends as data or as a counted miss; nothing blocks the worker.

Real StorageManager + plugin on real files. Each get runs in a thread joined with a timeout,
so a hang fails the test instead of stalling the suite.
"""

import asyncio
import os
import threading
import time

import pytest

from kvscope.testkit.lmcache_harness import assert_exact, chunk_path, key
from test_backend_prefetch import allocated, wait_for

NO_READ_AHEAD = {"kvscope.prefetch_on_lookup": False}


def get_within(h, indices, timeout_s=30.0):
    """``h.get(indices)`` in a thread; fails if it has not returned after ``timeout_s``."""
    box = []
    thread = threading.Thread(target=lambda: box.append(h.get(indices)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"get of {indices} still blocked after {timeout_s} s"
    return box[0]


def test_injected_reader_exception_is_a_miss_and_readers_survive(harness, tmp_path,
                                                                 monkeypatch):
    """The fault is injected (a bug in the reader cannot be provoked from outside): the first
    preadv of chunk 1's file raises RuntimeError."""
    h = harness(**NO_READ_AHEAD)
    h.put([0, 1, 2])
    target = os.path.realpath(chunk_path(tmp_path / "kv", 1))
    real_preadv, fired = os.preadv, []

    def preadv(fd, buffers, offset, *args):
        if not fired and os.readlink(f"/proc/self/fd/{fd}") == target:
            fired.append(fd)
            raise RuntimeError("injected reader fault")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", preadv)
    objs = get_within(h, [0, 1, 2])
    assert fired and objs[1] is None and objs[2] is None
    assert_exact(objs[:1], [0])
    assert h.backend.stats()["corrupt_by_reason"] == {"reader_error": 1}
    assert_exact(get_within(h, [0]), [0])  # every reader thread still serves
    assert_exact(get_within(h, [2]), [2])


def test_read_submitted_after_close_is_a_miss(harness):
    h = harness(**NO_READ_AHEAD)
    h.put([0])
    baseline = allocated(h)
    h.backend.close()
    box = []
    thread = threading.Thread(target=lambda: box.append(h.backend.batched_get_blocking([key(0)])),
                              daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "a get after close() never returned"
    assert box == [[None]]
    assert h.backend.stats()["miss_by_reason"] == {"closed": 1}
    assert allocated(h) == baseline


@pytest.mark.timeout(120)
def test_read_slower_than_the_timeout_is_a_miss_and_its_memory_returns_after(harness):
    h = harness(**NO_READ_AHEAD, **{"kvscope.read_delay_ms": 1500,
                                    "kvscope.read_timeout_s": 0.2})
    h.put([0])
    baseline = allocated(h)
    started = time.monotonic()
    assert get_within(h, [0]) == [None]
    waited = time.monotonic() - started
    stats = h.backend.stats()
    assert stats["miss_by_reason"] == {"timeout": 1} and stats["corrupt_by_reason"] == {}
    assert h.backend.contains(key(0))  # a slow read says nothing bad about the file
    if stats["reads_in_flight"]:
        # The reader may still write into the memory: it is not given back before it is done.
        assert allocated(h) > baseline, f"memory returned under a read in flight ({waited} s)"
    wait_for(lambda: h.backend.stats()["reads_in_flight"] == 0)
    wait_for(lambda: allocated(h) == baseline)


def test_async_path_read_slower_than_the_timeout_is_a_miss(harness):
    h = harness(**NO_READ_AHEAD, **{"kvscope.read_delay_ms": 1500,
                                    "kvscope.read_timeout_s": 0.2})
    h.put([0])
    served = asyncio.run(asyncio.wait_for(
        h.backend.batched_get_non_blocking("lookup-1", [key(0)]), 30))
    assert served == []
    assert h.backend.stats()["miss_by_reason"] == {"timeout": 1}
    wait_for(lambda: h.backend.stats()["reads_in_flight"] == 0)
