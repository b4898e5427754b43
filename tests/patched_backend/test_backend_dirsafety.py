# SPDX-License-Identifier: Apache-2.0
"""Issue 14 items 2 and 7: a private KV directory, one server per directory.

Item 2: the directory must be owned by the serving user and not group/world-writable (else
one line saying what to fix); it is created 0700, chunk files 0600; a chunk file someone
else owns, or a symlink put in a chunk's place, is never served. Item 7: a second backend on
a directory in use fails with a clear error naming the directory; the lock dies with its
holder (SIGKILL included). Real backends on real files (root: chown to another uid).
"""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.patched_backend.parallel_disk.backend import ParallelDiskBackend
from kvscope.patched_backend.parallel_disk.dirlock import DirectoryInUse
from kvscope.patched_backend.parallel_disk.dirsafety import UnsafeDirectory
from kvscope.testkit.lmcache_harness import assert_exact, chunk_path, lmcache_config, metadata

OTHER_UID = 12345


def _backend(path: Path) -> ParallelDiskBackend:
    """A backend with no CPU allocator (enough to start, scan and lock)."""
    return ParallelDiskBackend(config=lmcache_config(str(path)), metadata=metadata())


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_world_writable_directory_is_refused_in_one_line(tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir()
    os.chmod(kv, 0o777)
    with pytest.raises(UnsafeDirectory) as refused:
        _backend(kv)
    message = str(refused.value)
    assert "\n" not in message and "0777" in message and f"chmod 700 {kv}" in message


@pytest.mark.root
def test_directory_of_another_user_is_refused(tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    os.chown(kv, OTHER_UID, -1)
    with pytest.raises(UnsafeDirectory, match=f"owned by uid {OTHER_UID}"):
        _backend(kv)


def test_directory_created_private_and_chunks_0600(harness, tmp_path):
    kv = tmp_path / "a" / "b" / "kv"
    h = harness(kv)
    h.put([0])
    assert [_mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", kv)] == [0o700] * 3
    assert _mode(chunk_path(kv, 0)) == 0o600


@pytest.mark.root
def test_chunk_file_of_another_user_is_never_served(harness, tmp_path):
    kv = tmp_path / "kv"
    first = harness()
    first.put([0, 1])
    first.close()
    os.chown(chunk_path(kv, 1), OTHER_UID, -1)  # planted (as if the directory was open once)
    second = harness()
    assert second.backend.stats()["corrupt_by_reason"] == {"untrusted": 1}
    assert second.get([1]) == [None]
    assert_exact(second.get([0]), [0])
    assert os.path.exists(chunk_path(kv, 1))  # not ours to move


def test_symlink_in_place_of_an_indexed_chunk_is_not_followed(harness, tmp_path):
    kv = tmp_path / "kv"
    h = harness()
    h.put([0])
    elsewhere = tmp_path / "elsewhere.kvc"
    shutil.copy(chunk_path(kv, 0), elsewhere)
    os.unlink(chunk_path(kv, 0))
    os.symlink(elsewhere, chunk_path(kv, 0))
    assert h.get([0]) == [None]
    assert h.backend.stats()["corrupt_by_reason"] == {"untrusted": 1}


def test_second_backend_on_a_directory_in_use_gets_a_clear_error(harness, tmp_path):
    kv = tmp_path / "kv"
    first = harness()
    first.put([0])
    with pytest.raises(DirectoryInUse) as refused:
        _backend(kv)
    assert f"KV directory {kv} is in use by another kvscope server (pid {os.getpid()}" in str(
        refused.value)
    assert_exact(first.get([0]), [0])  # the first one is untouched
    first.close()
    second = harness()  # released at close
    assert_exact(second.get([0]), [0])


def test_lock_of_a_killed_server_is_free(tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from kvscope.patched_backend.parallel_disk.dirlock import DirectoryLock\n"
         f"DirectoryLock({str(kv)!r}).acquire(); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryInUse, match=f"pid {holder.pid}"):
            _backend(kv)
    finally:
        holder.kill()
        holder.wait()
    _backend(kv).close()


@pytest.mark.root
@pytest.mark.parametrize("parent_mode", ["755", "777"])
def test_a_kv_directory_under_a_parent_of_another_user_is_refused(shared_tmp, as_nobody,
                                                                 parent_mode):
    """Issue 19: the parent was never checked; its owner renamed the KV directory after start-up
    and put a link in its place, and root's next stores went where the link pointed."""
    as_nobody("mkdir", "-m", parent_mode, str(shared_tmp / "theirs"))
    kv = shared_tmp / "theirs" / "kv"
    if parent_mode == "777":
        kv.mkdir(mode=0o700)  # even a private directory of ours there
    with pytest.raises(UnsafeDirectory) as refused:
        _backend(kv)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"kvscope.path {kv}")
    assert f"parent {shared_tmp / 'theirs'} is owned by uid 65534" in message
