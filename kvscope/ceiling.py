"""The device ceiling: how fast this disk reads the run's own chunk files with nothing in the way.

A raw reader (O_DIRECT, `depth` threads each keeping one `unit`-byte preadv in flight, no
LMCache, no checksums) over the KV files, page cache dropped first. Every read-path figure is
reported beside this number, measured in the same run, because shared machines drift.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from kvscope.workload import system

HUGE_PAGE = 2 << 20
DEFAULT_UNIT = 4 << 20
DEFAULT_DEPTH = 32


@dataclass(frozen=True)
class Ceiling:
    bytes_per_s: float
    bytes: int
    seconds: float
    files: int
    unit: int
    depth: int
    method: str = "raw O_DIRECT preadv, page cache dropped"

    def as_dict(self) -> dict:
        return asdict(self)


def huge_buffer(nbytes: int) -> memoryview:
    """A 2 MiB-aligned private anonymous buffer backed by transparent huge pages, touched.

    With 4 KiB pages a virtio-blk request carries at most ~1 MiB (its segment limit); huge pages
    let one O_DIRECT request carry 4 MiB, as LMCache's own pinned pool does.
    """
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mm)) % HUGE_PAGE
    view = memoryview(mm)[start:start + nbytes]
    view[:] = b"\1" * nbytes
    return view


def read_files(files: list[Path], unit: int = DEFAULT_UNIT, depth: int = DEFAULT_DEPTH) -> Ceiling:
    """Read every file once with `depth` O_DIRECT readers; sizes must be 4 KiB multiples."""
    work = deque(
        (path, offset, min(unit, size - offset))
        for path in files for size in [path.stat().st_size] for offset in range(0, size, unit)
    )
    total = sum(n for _, _, n in work)
    lock = threading.Lock()
    fds = {path: os.open(path, os.O_RDONLY | os.O_DIRECT) for path in files}

    def reader(view: memoryview) -> None:
        while True:
            with lock:
                if not work:
                    return
                path, offset, n = work.popleft()
            os.preadv(fds[path], [view[:n]], offset)

    threads = [threading.Thread(target=reader, args=(huge_buffer(unit),)) for _ in range(depth)]
    started = time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for fd in fds.values():
            os.close(fd)
    seconds = time.perf_counter() - started
    return Ceiling(total / seconds if seconds else 0.0, total, seconds, len(files), unit, depth)


def chunk_files(kv_dir: Path, limit_bytes: int) -> list[Path]:
    """The largest 4 KiB-aligned files under kv_dir, up to limit_bytes in all."""
    files = sorted((p for p in Path(kv_dir).rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size, reverse=True)
    chosen, total = [], 0
    for path in files:
        size = path.stat().st_size
        if size == 0 or size % 4096 or total >= limit_bytes:
            continue
        chosen.append(path)
        total += size
    return chosen


def measure(kv_dir: Path, limit_bytes: int = 4 << 30) -> Ceiling | None:
    """The ceiling over the run's chunk files (None when there are none); needs root."""
    files = chunk_files(kv_dir, limit_bytes)
    if not files:
        return None
    system.drop_page_cache()
    return read_files(files)
