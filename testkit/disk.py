"""Where a test file's bytes lie on disk, from e2fsprogs' filefrag: an account of the sectors
independent of kvscope's own FIEMAP reader (kvscope.tracer.extents)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def _extents(path: Path) -> list[tuple[int, int, int]]:
    """(first file sector, last file sector, first whole-disk sector) of each extent: filefrag's
    physical offsets plus the partition's start, 512 B sectors."""
    out = subprocess.run(["filefrag", "-v", "-b512", str(path)], check=True,
                         capture_output=True, text=True).stdout
    st_dev = path.stat().st_dev
    start_file = Path(f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}/start")
    base = int(start_file.read_text()) if start_file.exists() else 0
    extents = []
    for line in out.splitlines():
        parts = line.replace("..", " ").replace(":", " ").split()
        if len(parts) >= 5 and parts[0].isdigit():
            extents.append((int(parts[1]), int(parts[2]), base + int(parts[3])))
    return extents


def disk_sectors(path: Path) -> list[tuple[int, int]]:
    """[first, last] whole-disk sectors of each extent of `path`, in file order."""
    return [(disk, disk + last - first) for first, last, disk in _extents(path)]


def byte_range_sectors(path: Path, offset: int, length: int) -> set[int]:
    """Every whole-disk sector holding bytes [offset, offset + length) of `path`."""
    lo, hi = offset // 512, -(-(offset + length) // 512)
    return {disk + s - first for first, last, disk in _extents(path)
            for s in range(max(lo, first), min(hi, last + 1))}
