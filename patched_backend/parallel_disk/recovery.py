# SPDX-License-Identifier: Apache-2.0
"""Start-up scan: rebuild the index from the chunk files on disk (true cold-start hits).

Only headers are read (4 KiB per chunk); payload hashes are checked when a chunk is read.
Nothing in a file can stop the tier from starting: every file is indexed, left alone (another
engine's chunk), or refused with a reason and counted. Damaged files are moved aside
(``*.corrupt``); valid chunks this engine cannot use (another layout or format version, or
a file it does not trust) are left where they are: a later store of the same key replaces
them. Temporary files are all deleted: the directory lock (dirlock.py) proves their writer
is gone.
"""

import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

from kvscope.patched_backend.parallel_disk.chunkfile import (
    QUARANTINE_SUFFIX, SUFFIX, TEMP_PREFIX, ChunkHeader, CorruptChunk, file_name,
    file_size_for, read_header,
)

logger = logging.getLogger(__name__)

# (reason, detail) when the header cannot be served to this engine, None when it fits.
GeometryCheck = Callable[[ChunkHeader], Optional[tuple[str, str]]]
# False for a well-formed chunk of another engine or rank sharing the directory: left alone.
Ownership = Callable[[ChunkHeader], bool]
# The LMCache key of a header's key string; raises on bad syntax.
KeyParser = Callable[[str], Hashable]

# Refusals that leave the file in place (valid, just not for this engine or not trusted).
LEFT_IN_PLACE = ("layout", "format_version", "untrusted")


@dataclass
class Found:
    """A valid chunk file found by the scan."""

    key: Hashable
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


def scan(directory: str, owns: Ownership, check: GeometryCheck,
         parse_key: KeyParser) -> ScanResult:
    """Read every chunk header in ``directory``; quarantine what is damaged. Never raises for
    a file's content (only when the directory itself cannot be listed)."""
    result = ScanResult()
    with os.scandir(directory) as it:
        names = sorted(entry.name for entry in it if entry.is_file(follow_symlinks=False))
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith(TEMP_PREFIX):
            result.temp_files_removed += _remove(path)
        elif name.endswith(SUFFIX):
            _scan_one(path, owns, check, parse_key, result)
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


def _scan_one(path: str, owns: Ownership, check: GeometryCheck, parse_key: KeyParser,
              result: ScanResult) -> None:
    try:
        found = _examine(path, owns, check, parse_key)
    except CorruptChunk as exc:
        result.refused.append((path, exc))
        if exc.reason not in LEFT_IN_PLACE:
            quarantine(path)
        return
    except Exception as exc:  # anything else a hostile file provokes: refused, never fatal
        result.refused.append((path, CorruptChunk("corrupt_header",
                                                  f"{type(exc).__name__}: {exc}")))
        quarantine(path)
        return
    if found is None:
        result.not_ours += 1
    else:
        result.chunks.append(found)


def _examine(path: str, owns: Ownership, check: GeometryCheck,
             parse_key: KeyParser) -> Optional[Found]:
    """The file's index entry, None when it belongs to another engine; CorruptChunk if refused."""
    header, st = read_header(path)
    _require_trusted(path, st)
    if not owns(header):
        return None
    if os.path.basename(path) != file_name(header.key):
        raise CorruptChunk("misnamed", f"file name is not the hash of key {header.key!r}")
    try:
        key = parse_key(header.key)
    except Exception as exc:
        raise CorruptChunk("corrupt_header", f"key {header.key!r}: {exc}") from None
    if st.st_size != file_size_for(header.payload_len):
        raise CorruptChunk("truncated", f"{st.st_size} bytes, expected "
                           f"{file_size_for(header.payload_len)}")
    mismatch = check(header)
    if mismatch:
        raise CorruptChunk(*mismatch)
    return Found(key, path, header, st.st_size, (st.st_dev, st.st_ino, st.st_size),
                 st.st_mtime_ns)


def _require_trusted(path: str, st: os.stat_result) -> None:
    """A chunk someone else owns or may rewrite could be planted: never index it."""
    if st.st_uid != os.geteuid():
        raise CorruptChunk("untrusted", f"{path} is owned by uid {st.st_uid}, not {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise CorruptChunk("untrusted", f"{path} is group/world-writable "
                           f"({stat.S_IMODE(st.st_mode):04o})")


def _remove(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


def describe(refused: list[tuple[str, CorruptChunk]]) -> list[str]:
    """One log line per reason: count, what happens to the files, one example."""
    by_reason: dict[str, list[tuple[str, Any]]] = {}
    for path, exc in refused:
        by_reason.setdefault(exc.reason, []).append((path, exc))
    lines = []
    for reason, files in sorted(by_reason.items()):
        fate = "left in place" if reason in LEFT_IN_PLACE else f"moved to *{QUARANTINE_SUFFIX}"
        path, exc = files[0]
        lines.append(f"{len(files)} chunk file(s) refused at start-up ({reason}), {fate}; "
                     f"e.g. {path}: {exc}")
    return lines
