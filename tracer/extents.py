# SPDX-License-Identifier: Apache-2.0
"""Where a file's bytes lie on its disk: whole-disk 512 B sector ranges, from FIEMAP.

A storage read span carries the sectors of every chunk it read, so analysis can give each
block-layer read (the probes' dev + sector) to the chunk, and so the request, it read, whatever
thread or I/O engine issued it (docs/run-directory.md, "Joining block reads to requests").
FS_IOC_FIEMAP gives physical byte offsets inside the file system's block device; adding the
partition's start makes them whole-disk sectors, the ones block requests carry. Only file
systems straight on a request-based disk or a partition of one qualify: under dm, md or NVMe
multipath the requests the probes see are remapped, so no ranges are given there.
"""

from __future__ import annotations

import fcntl
import functools
import os
import struct
from pathlib import Path

FS_IOC_FIEMAP = 0xC020660B  # _IOWR('f', 11, struct fiemap), include/uapi/linux/fs.h
_FIEMAP = struct.Struct("=QQIIII")  # fm_start, fm_length, fm_flags, fm_mapped_extents,
# fm_extent_count, fm_reserved
_EXTENT = struct.Struct("=QQQQQI12x")  # fe_logical, fe_physical, fe_length, 2 reserved, fe_flags
MAX_EXTENTS = 512
# fe_flags whose physical offset is not a plain on-disk location (linux/fiemap.h): unknown,
# delayed allocation, encoded, inline in metadata, not block-aligned, tail-packed
_UNLOCATABLE = 0x2 | 0x4 | 0x8 | 0x200 | 0x100 | 0x400
SECTOR = 512

Identity = tuple[int, int, int]  # st_dev, st_ino, st_size
Sectors = tuple[tuple[int, int], ...]  # [start, end) whole-disk sectors, in file order


def file_sectors(path: str, identity: Identity | None, offset: int,
                 length: int) -> Sectors | None:
    """Sector ranges holding bytes [offset, offset + length) of `path`; None when they cannot
    be known (another file under the name, no FIEMAP, unallocated bytes, no plain disk)."""
    if identity is None:
        return _sectors(path, None, offset, length)
    return _cached_sectors(path, identity, offset, length)


@functools.lru_cache(maxsize=8192)
def _cached_sectors(path: str, identity: Identity, offset: int, length: int) -> Sectors | None:
    """The same, remembered per file identity: a chunk file's blocks do not move once written."""
    return _sectors(path, identity, offset, length)


def _sectors(path: str, identity: Identity | None, offset: int, length: int) -> Sectors | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if identity is not None and (st.st_dev, st.st_ino) != identity[:2]:
            return None
        base = partition_start(st.st_dev)
        extents = _fiemap(fd, offset, length)
    except OSError:
        return None
    finally:
        os.close(fd)
    if base is None or extents is None:
        return None
    return _clip(extents, offset, offset + length, base)


def partition_start(st_dev: int, sys_root: Path = Path("/sys")) -> int | None:
    """First whole-disk sector of the device `st_dev` (0 for a whole disk), None when it is not
    a request-based disk or a partition of one (dm, md, multipath heads, tmpfs...)."""
    node = sys_root / "dev" / "block" / f"{os.major(st_dev)}:{os.minor(st_dev)}"
    if not node.exists():
        return None
    node = node.resolve()
    disk = node.parent if (node / "partition").exists() else node
    if not (disk / "mq").is_dir():
        return None
    start = node / "start"
    return int(start.read_text()) if disk != node else 0


def _fiemap(fd: int, offset: int, length: int) -> list[tuple[int, int, int]] | None:
    """(logical, physical, length) bytes of the extents over [offset, offset + length)."""
    request = bytearray(_FIEMAP.size + MAX_EXTENTS * _EXTENT.size)
    _FIEMAP.pack_into(request, 0, offset, length, 0, 0, MAX_EXTENTS, 0)
    fcntl.ioctl(fd, FS_IOC_FIEMAP, request)
    mapped = _FIEMAP.unpack_from(request, 0)[3]
    extents = []
    for i in range(mapped):
        logical, physical, size, _, _, flags = _EXTENT.unpack_from(
            request, _FIEMAP.size + i * _EXTENT.size)
        if flags & _UNLOCATABLE:
            return None
        extents.append((logical, physical, size))
    return extents


def _clip(extents: list[tuple[int, int, int]], start: int, end: int,
          base: int) -> Sectors | None:
    """The parts of `extents` inside file bytes [start, end) as whole-disk sectors; None when
    the extents do not cover all of it (a hole, or more extents than one call returns)."""
    out: list[tuple[int, int]] = []
    covered = 0
    for logical, physical, size in extents:
        lo, hi = max(start, logical), min(end, logical + size)
        if lo >= hi:
            continue
        first = physical + lo - logical
        out.append((base + first // SECTOR, base + -(-(first + hi - lo) // SECTOR)))
        covered += hi - lo
    return tuple(out) if covered == end - start else None
