# SPDX-License-Identifier: Apache-2.0
"""Start-up scan: rebuild the index from the chunk files on disk (true cold-start hits).

Only headers are read (4 KiB per chunk); payload checksums are checked when a chunk is read.
Files that cannot be served are reported and moved aside (``*.corrupt``), never indexed.
Temporary files left by a writer that died (kill -9) are deleted.
"""

# Standard
from dataclasses import dataclass, field
from typing import Callable, Optional
import logging
import os

# First Party
from patched_backend.parallel_disk.chunkfile import (
    QUARANTINE_SUFFIX, SUFFIX, ChunkHeader, CorruptChunk, file_size_for, read_header,
    temp_owner_pid,
)

logger = logging.getLogger(__name__)

# Returns None when the header fits this engine, else why it does not (a "foreign" chunk).
GeometryCheck = Callable[[ChunkHeader], Optional[str]]
# False for a well-formed chunk of another engine or rank sharing the directory: left alone.
Ownership = Callable[[ChunkHeader], bool]


@dataclass
class Found:
    """A valid chunk file found by the scan."""

    path: str
    header: ChunkHeader
    file_size: int
    identity: tuple[int, int, int]
    mtime_ns: int


@dataclass
class ScanResult:
    """Valid chunks (oldest first) and the refused files with their reasons."""

    chunks: list[Found] = field(default_factory=list)
    refused: list[tuple[str, CorruptChunk]] = field(default_factory=list)
    not_ours: int = 0
    temp_files_removed: int = 0


def scan(directory: str, owns: Ownership, check: GeometryCheck) -> ScanResult:
    """Read every chunk header in ``directory``; quarantine what cannot be served."""
    result = ScanResult()
    with os.scandir(directory) as it:
        names = sorted(entry.name for entry in it if entry.is_file(follow_symlinks=False))
    for name in names:
        path = os.path.join(directory, name)
        if temp_owner_pid(name) is not None:
            result.temp_files_removed += _remove_dead_temp(path, temp_owner_pid(name))
        elif name.endswith(SUFFIX):
            _scan_one(path, owns, check, result)
    result.chunks.sort(key=lambda found: found.mtime_ns)
    return result


def quarantine(path: str) -> None:
    """Move a refused chunk file aside so no later scan indexes it; keeps it for inspection."""
    try:
        os.replace(path, path + QUARANTINE_SUFFIX)
    except FileNotFoundError:
        pass
    except OSError:
        logger.warning("could not move %s aside", path, exc_info=True)


def _scan_one(path: str, owns: Ownership, check: GeometryCheck, result: ScanResult) -> None:
    try:
        header, st = read_header(path)
        if not owns(header):
            result.not_ours += 1
            return
        if st.st_size != file_size_for(header.payload_len):
            raise CorruptChunk("truncated", f"{st.st_size} bytes, expected "
                               f"{file_size_for(header.payload_len)}")
        mismatch = check(header)
        if mismatch:
            raise CorruptChunk("foreign", mismatch)
    except CorruptChunk as exc:
        result.refused.append((path, exc))
        quarantine(path)
        return
    except (OSError, ValueError, KeyError) as exc:
        result.refused.append((path, CorruptChunk("corrupt_header", str(exc))))
        quarantine(path)
        return
    result.chunks.append(
        Found(path, header, st.st_size, (st.st_dev, st.st_ino, st.st_size), st.st_mtime_ns)
    )


def _remove_dead_temp(path: str, pid: Optional[int]) -> int:
    if pid is not None and _alive(pid):
        return 0
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
