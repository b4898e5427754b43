# SPDX-License-Identifier: Apache-2.0
"""The raw O_DIRECT reader: how fast the disk gives the chunk files with nothing in the way (no
LMCache, no checksums), reading into huge-page buffers as LMCache's pinned pool does.

Both the device ceiling (capture/ceiling.py) and the tuner (tune.py) measure with it. It lives in
the backend's room so that the tuner never imports capture, which imports the backend.
"""

import ctypes
import errno
import mmap
import os
import stat
import threading
import time
from collections import deque
from pathlib import Path

from kvscope.patched_backend.parallel_disk.buffers import HUGE_PAGE


def huge_buffer(nbytes: int) -> memoryview:
    """A 2 MiB-aligned private anonymous buffer backed by transparent huge pages, touched.

    With 4 KiB pages a virtio-blk request carries at most ~1 MiB (its segment limit); huge pages
    let one O_DIRECT request carry 4 MiB, as LMCache's own pinned pool does.
    """
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    start = -address % HUGE_PAGE
    ctypes.memset(address + start, 1, nbytes)  # touched in place: no second copy in memory
    return memoryview(mm)[start:start + nbytes]


def read_files(files: list[Path], unit: int, depth: int) -> tuple[int, float]:
    """Read every file once with `depth` O_DIRECT readers, each keeping one `unit`-byte preadv
    in flight; the bytes read and the seconds it took. Sizes must be 4 KiB multiples.

    Raises:
        OSError: a file is a link (ELOOP) or no regular file (`open_direct`), or unreadable.
    """
    fds: dict[Path, int] = {}
    try:
        for path in files:
            fds[path] = open_direct(path)
        work = deque((path, offset, min(unit, size - offset))
                     for path, fd in fds.items() for size in [os.fstat(fd).st_size]
                     for offset in range(0, size, unit))
        total = sum(n for _, _, n in work)
        lock = threading.Lock()

        def reader(view: memoryview) -> None:
            while True:
                with lock:
                    if not work:
                        return
                    path, offset, n = work.popleft()
                os.preadv(fds[path], [view[:n]], offset)

        threads = [threading.Thread(target=reader, args=(huge_buffer(unit),))
                   for _ in range(depth)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return total, time.perf_counter() - started
    finally:
        for fd in fds.values():
            os.close(fd)


def open_direct(path: Path) -> int:
    """`path` open for O_DIRECT reads, if it is a regular file. Never through a link
    (O_NOFOLLOW: OSError ELOOP); opened non-blocking, so a FIFO's open does not wait for a
    writer, and anything but a regular file is refused (OSError EINVAL) before a read."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file; the ceiling reads chunk files only",
                      str(path))
    os.set_blocking(fd, True)
    return fd
