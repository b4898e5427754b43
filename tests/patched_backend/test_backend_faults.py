# SPDX-License-Identifier: Apache-2.0
"""Faults on the write side: a full file system (ENOSPC) and a writer killed with SIGKILL."""

import os
import signal
import subprocess
import sys

import pytest

from kvscope.patched_backend.parallel_disk.chunkfile import SUFFIX, TEMP_PREFIX
from kvscope.testkit.lmcache_harness import assert_exact

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def tiny_fs(tmpfs):
    """A 3 MiB tmpfs (real ENOSPC)."""
    return tmpfs("3m")


@pytest.mark.root
def test_enospc_skips_the_store_and_keeps_serving(harness, tiny_fs):
    from kvscope.patched_backend.parallel_disk import hooks

    failed = []

    class Failed:
        def on_store(self, event) -> None:
            if not event.ok:
                failed.append(event)

    listener = Failed()
    hooks.add_listener(listener)
    h = harness(tiny_fs)  # capacity 1 GiB in config, but the file system holds ~5 chunks
    try:
        h.put(list(range(12)))
    finally:
        hooks.remove_listener(listener)
    stats = h.backend.stats()
    assert len(failed) == stats["store_failures"]
    assert {e.reason for e in failed} == {"ENOSPC"}, {e.error for e in failed}
    assert stats["store_failures"] > 0, stats
    assert stats["stores"] + stats["store_failures"] == 12
    stored = [i for i in range(12) if h.backend.contains(_key(i))]
    assert len(stored) == stats["stores"]
    assert_exact(h.get(stored[:1]), stored[:1])
    for i in stored:
        assert_exact(h.get([i]), [i])
    assert not [n for n in os.listdir(tiny_fs) if n.startswith(TEMP_PREFIX)]


def test_kill_9_mid_write_leaves_only_complete_chunks(harness, tmp_path):
    kv = tmp_path / "kv"
    child = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "writer_child.py"), str(kv)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=HERE,
    )
    try:
        for line in child.stdout:  # kill once 40 are queued and at least one is on disk
            if int(line.split()[1]) >= 39 and any(n.endswith(SUFFIX) for n in os.listdir(kv)):
                break
        else:
            pytest.fail("writer child exited before queueing 40 chunks and writing one")
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    on_disk = os.listdir(kv)
    h = harness(kv)
    found = [i for i in range(10_000) if h.backend.contains(_key(i))]
    assert found, f"no complete chunk survived: {on_disk}"
    for i in found:
        assert_exact(h.get([i]), [i])
    names = os.listdir(kv)
    assert not [n for n in names if n.startswith(TEMP_PREFIX)]
    assert len([n for n in names if n.endswith(SUFFIX)]) == len(found)
    assert h.backend.stats()["corrupt_chunks"] == 0


def _key(i):
    from kvscope.testkit.lmcache_harness import key

    return key(i)
