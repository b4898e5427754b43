# SPDX-License-Identifier: Apache-2.0
"""A known O_DIRECT read workload (count, size, queue depth) to check and benchmark the probes.

Reads never touch adjacent blocks (a gap of one block between them), so the I/O scheduler
cannot merge two reads into one request: N reads here are N block requests.

    python -m probes.loadgen FILE --count 23 --size 65536 --depth 4
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time
from pathlib import Path


def make_file(path: Path, size_bytes: int) -> None:
    """A file of real (non-sparse) data blocks, flushed to the device; block devices are kept."""
    if path.is_block_device() or (path.exists() and path.stat().st_size >= size_bytes):
        return
    with open(path, "wb") as f:
        for _ in range(0, size_bytes, 1 << 20):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())


def read_direct(path: Path, *, count: int, size: int, depth: int,
                duration_s: float | None = None) -> int:
    """Issue `count` reads of `size` bytes from `depth` threads (or until `duration_s` passes).

    Returns the number of reads done. Offsets cycle through the file with a one-block gap.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    slots = os.lseek(fd, 0, os.SEEK_END) // (2 * size)  # works for files and block devices
    if slots < 1:
        os.close(fd)
        raise ValueError(f"{path} is smaller than two blocks of {size} bytes; make it larger")
    deadline = None if duration_s is None else time.monotonic() + duration_s
    done = [0] * depth

    def worker(first: int) -> None:
        buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
        for i in range(first, count, depth):
            if deadline is not None and time.monotonic() > deadline:
                return
            if os.preadv(fd, [buf], (i % slots) * 2 * size) != size:
                raise OSError(f"short read at block {i} of {path}")
            done[first] += 1

    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(depth)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    return sum(done)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="example: python -m probes.loadgen /var/tmp/f --count 23 --depth 4  # 23 reads",
    )
    parser.add_argument("file", type=Path, help="file to read (made with random data if small)")
    parser.add_argument("--count", type=int, default=23, help="reads to issue")
    parser.add_argument("--size", type=int, default=65536, help="bytes per read (4096 multiple)")
    parser.add_argument("--depth", type=int, default=4, help="reads in flight (threads)")
    parser.add_argument("--duration", type=float, help="stop after this many seconds")
    parser.add_argument("--file-size", type=int, default=64 << 20, help="bytes of the file")
    parser.add_argument("--ready", action="store_true",
                        help="print 'ready' and wait for a line on stdin before reading")
    args = parser.parse_args(argv)
    make_file(args.file, args.file_size)
    if args.ready:
        print("ready", flush=True)
        sys.stdin.readline()
    done = read_direct(args.file, count=args.count, size=args.size, depth=args.depth,
                       duration_s=args.duration)
    print(done, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
