# SPDX-License-Identifier: Apache-2.0
"""The chunk file format: a 4 KiB header, then the payload padded to 4 KiB.

Why a header: the stock LMCache disk tier writes raw bytes and keeps shape/dtype in memory only,
so its files cannot be found again after a restart nor verified. Ours carry the key, geometry
and a CRC32 of the payload, and are published with write-temp / fsync / rename so a reader never
sees a half-written chunk under the final name.

Version 2 checksums with CRC32C (Castagnoli; SSE4.2 / ARMv8 instructions through
``google-crc32c``): ~12-17 GB/s on one core here against ~7 GB/s for zlib's CRC32, which
version 1 used. Files of another version are refused as ``foreign`` (a miss, recomputed).

Layout (little endian)::

    0      8s  magic  b"KVSCOPE\\x01"
    8      I   format version (2)
    12     I   meta_len: bytes of UTF-8 JSON metadata that follow the fixed part
    16     Q   payload_len: payload bytes (before padding)
    24     I   crc_block: bytes covered by each payload CRC (1 MiB, more for huge chunks)
    28     I   header_crc: CRC32C of bytes [0, 28) + the JSON metadata
    32     ... JSON metadata: key, shape, dtype, fmt, cached_positions, geometry, and
               crcs: base64 of little-endian uint32 CRC32C of each crc_block of payload
    ...    zero padding up to 4096
    4096   payload, zero padded to a multiple of 4096
"""

# Standard
from dataclasses import dataclass, field
from typing import Any, Optional
import base64
import ctypes
import hashlib
import json
import os
import struct
import threading

# Third Party
import google_crc32c

MAGIC = b"KVSCOPE\x01"
VERSION = 2
ALIGN = 4096
HEADER_SIZE = 4096
SUFFIX = ".kvc"
TEMP_PREFIX = ".tmp."
QUARANTINE_SUFFIX = ".corrupt"
MAX_CRC_BLOCKS = 256
_FIXED = struct.Struct("<8sIIQII")


class CorruptChunk(Exception):
    """A chunk file that must not be served; ``reason`` is a short stable word for counters."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class ChunkHeader:
    """What a chunk file says about itself (enough to allocate and verify its payload)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    fmt: str
    payload_len: int
    crc_block: int
    crcs: tuple[int, ...]
    cached_positions: Optional[list[int]] = None
    geometry: dict[str, Any] = field(default_factory=dict)


def padded(nbytes: int) -> int:
    """Round up to the O_DIRECT alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def file_size_for(payload_len: int) -> int:
    """On-disk size of a chunk file holding ``payload_len`` payload bytes."""
    return HEADER_SIZE + padded(payload_len)


def file_name(key: str) -> str:
    """Stable file name for a key string (keys hold '/' and can be long, so hash them)."""
    return hashlib.sha256(key.encode()).hexdigest()[:40] + SUFFIX


def crc_block_for(payload_len: int) -> int:
    """CRC block size: 1 MiB, grown for huge chunks so the CRC list fits the header."""
    mib = 1 << 20
    return max(mib, -(-payload_len // MAX_CRC_BLOCKS // mib) * mib)


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C of a buffer, continuing from ``crc``; no copy for writable buffers.

    ``google_crc32c`` releases the GIL but takes only buffers without a release hook (bytes,
    ctypes arrays), not memoryviews: a writable buffer is wrapped in a ctypes array over the
    same memory, a read-only one (tests, small headers) is copied to bytes.
    """
    view = memoryview(data).cast("B")
    if view.readonly:
        buf: Any = view.tobytes()
    else:
        buf = (ctypes.c_ubyte * len(view)).from_buffer(view)
    return google_crc32c.extend(crc, buf)


def block_crcs(payload: memoryview, block: int) -> tuple[int, ...]:
    """CRC32C of each ``block`` bytes of the payload.

    Per-block CRCs let each reader thread verify the blocks it just read while other reads
    are in flight, instead of one pass over the whole chunk after its last read.
    """
    view = memoryview(payload).cast("B")
    return tuple(crc32c(view[i : i + block]) for i in range(0, len(view), block))


def encode_header(header: ChunkHeader) -> bytes:
    """The 4096-byte header block; ValueError when the metadata does not fit."""
    meta = json.dumps(
        {
            "key": header.key, "shape": list(header.shape), "dtype": header.dtype,
            "fmt": header.fmt, "cached_positions": header.cached_positions,
            "geometry": header.geometry,
            "crcs": base64.b64encode(struct.pack(f"<{len(header.crcs)}I", *header.crcs)).decode(),
        },
        separators=(",", ":"),
    ).encode()
    if _FIXED.size + len(meta) > HEADER_SIZE:
        raise ValueError(f"chunk metadata of {len(meta)} bytes does not fit the 4 KiB header")
    head = struct.pack("<8sIIQI", MAGIC, VERSION, len(meta), header.payload_len, header.crc_block)
    header_crc = crc32c(meta, crc32c(head))
    block = head + struct.pack("<I", header_crc) + meta
    return block + b"\0" * (HEADER_SIZE - len(block))


def decode_header(block: bytes, file_size: int) -> ChunkHeader:
    """Parse and check a header block against the file's size; raises CorruptChunk."""
    if len(block) < _FIXED.size:
        raise CorruptChunk("truncated", f"{len(block)} header bytes")
    magic, version, meta_len, payload_len, crc_block, header_crc = _FIXED.unpack_from(block)
    if magic != MAGIC:
        raise CorruptChunk("foreign", "not a kvscope chunk file (bad magic)")
    if version != VERSION:
        raise CorruptChunk("foreign", f"format version {version}, expected {VERSION}")
    if _FIXED.size + meta_len > min(len(block), HEADER_SIZE):
        raise CorruptChunk("corrupt_header", f"metadata length {meta_len}")
    meta = block[_FIXED.size : _FIXED.size + meta_len]
    if crc32c(meta, crc32c(block[:28])) != header_crc:
        raise CorruptChunk("corrupt_header", "header checksum mismatch")
    if file_size < file_size_for(payload_len):
        raise CorruptChunk("truncated", f"{file_size} bytes, expected {file_size_for(payload_len)}")
    data = json.loads(meta)
    packed = base64.b64decode(data["crcs"])
    crcs = struct.unpack(f"<{len(packed) // 4}I", packed)
    if crc_block <= 0 or len(crcs) != -(-payload_len // crc_block):
        raise CorruptChunk("corrupt_header", f"{len(crcs)} CRCs for {payload_len} bytes")
    return ChunkHeader(
        key=data["key"], shape=tuple(data["shape"]), dtype=data["dtype"], fmt=data["fmt"],
        payload_len=payload_len, crc_block=crc_block, crcs=crcs,
        cached_positions=data.get("cached_positions"), geometry=data.get("geometry") or {},
    )


def read_header(path: str) -> tuple[ChunkHeader, os.stat_result]:
    """Header and stat of a chunk file (start-up scan; buffered, 4 KiB)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        return decode_header(os.pread(fd, HEADER_SIZE, 0), st.st_size), st
    finally:
        os.close(fd)


def temp_name(name: str) -> str:
    """Temporary name of a chunk being written by this process and thread."""
    return f"{TEMP_PREFIX}{name}.{os.getpid()}.{threading.get_native_id()}"


def temp_owner_pid(name: str) -> Optional[int]:
    """PID that wrote a temporary file, None if ``name`` is not one of ours."""
    if not name.startswith(TEMP_PREFIX):
        return None
    parts = name.split(".")
    try:
        return int(parts[-2])
    except (IndexError, ValueError):
        return None


def write_chunk(directory: str, header: ChunkHeader, payload: memoryview) -> tuple[str, os.stat_result]:
    """Durably publish one chunk: write a temp file, fsync, rename, fsync the directory.

    On any OSError (ENOSPC, EIO, ...) the temp file is removed and the error re-raised; the
    final name is never left half-written.
    """
    name = file_name(header.key)
    final = os.path.join(directory, name)
    temp = os.path.join(directory, temp_name(name))
    pad = b"\0" * (padded(header.payload_len) - header.payload_len)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, [encode_header(header), payload, pad])
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(temp)
        raise
    os.close(fd)
    try:
        os.rename(temp, final)
        _fsync_dir(directory)
    except BaseException:
        _unlink_quietly(temp)
        raise
    return final, st


def _write_all(fd: int, parts: list[Any]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
