# SPDX-License-Identifier: Apache-2.0
"""The chunk file format: a 4 KiB header, then the payload padded to 4 KiB.

Why a header: the stock LMCache disk tier writes raw bytes and keeps shape/dtype in memory only,
so its files cannot be found again after a restart nor verified. Ours carry the key, geometry,
the physical layout identity of the bytes (layout.py) and a checksum of every payload block,
and are published with write-temp / fsync / rename so a reader never sees a half-written chunk
under the final name.

Version 3 checksums every 1 MiB block with XXH3-64 (``xxhash``: ~16 GB/s on one core here
when quiet, GIL released in ``update``, against 5-7 GB/s for CRC32C, which version 2 used, and ~7 GB/s for zlib's CRC32
of version 1) and records the layout identity. Files of another version are refused as
``format_version`` (a miss, recomputed; the file is left for a later store to replace).

Layout (little endian)::

    0      8s  magic  b"KVSCOPE\\x01"
    8      I   format version (3)
    12     I   meta_len: bytes of UTF-8 JSON metadata that follow the fixed part
    16     Q   payload_len: payload bytes (before padding)
    24     I   hash_block: bytes covered by each payload hash (1 MiB, more for huge chunks)
    28     I   reserved (0)
    32     Q   header_hash: XXH3-64 of bytes [0, 32) + the JSON metadata
    40     ... JSON metadata: key, shape, dtype, fmt, cached_positions, geometry, layout, and
               hashes: base64 of little-endian uint64 XXH3-64 of each hash_block of payload
    ...    zero padding up to 4096
    4096   payload, zero padded to a multiple of 4096

``decode_header`` checks every field (types, ranges, sizes agree with shape and dtype) so that
nothing read from a file can raise anything but ``CorruptChunk`` later.
"""

import base64
import binascii
import hashlib
import json
import math
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import xxhash

MAGIC = b"KVSCOPE\x01"
VERSION = 3
ALIGN = 4096
HEADER_SIZE = 4096
SUFFIX = ".kvc"
TEMP_PREFIX = ".tmp."
QUARANTINE_SUFFIX = ".corrupt"
MAX_HASH_BLOCKS = 256
FILE_MODE = 0o600
_FIXED = struct.Struct("<8sIIQIIQ")
_HASHED = 32  # bytes of the fixed part covered by header_hash
# Element sizes of the dtypes a KV chunk may hold (names as str(torch.dtype)).
DTYPE_SIZES = {
    "torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2, "torch.float64": 8,
    "torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1, "torch.uint8": 1, "torch.int8": 1,
}
FORMATS = ("KV_2LTD", "KV_T2D", "KV_2TD", "KV_MLA_FMT")
_MAX_DIM = 1 << 31


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
    hash_block: int
    hashes: tuple[int, ...]
    cached_positions: Optional[list[int]] = None
    geometry: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)


def padded(nbytes: int) -> int:
    """Round up to the O_DIRECT alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def file_size_for(payload_len: int) -> int:
    """On-disk size of a chunk file holding ``payload_len`` payload bytes."""
    return HEADER_SIZE + padded(payload_len)


def file_name(key: str) -> str:
    """Stable file name for a key string (keys hold '/' and can be long, so hash them)."""
    return hashlib.sha256(key.encode()).hexdigest()[:40] + SUFFIX


def hash_block_for(payload_len: int) -> int:
    """Hash block size: 1 MiB, grown for huge chunks so the hash list fits the header."""
    mib = 1 << 20
    return max(mib, -(-payload_len // MAX_HASH_BLOCKS // mib) * mib)


def hash64(data: Any) -> int:
    """XXH3-64 of a buffer (any buffer: bytes, memoryview of raw memory); no copy.

    Through a hasher's ``update``, which releases the GIL for large inputs (the one-shot
    ``xxh3_64_intdigest`` holds it: measured here, two threads hashed no faster than one, and
    the reader threads verifying 1 MiB blocks serialised on it: 0.67 x the device ceiling).
    """
    hasher = xxhash.xxh3_64()
    hasher.update(data)
    return hasher.intdigest()


def block_hashes(payload: Any, block: int) -> tuple[int, ...]:
    """XXH3-64 of each ``block`` bytes of the payload.

    Per-block hashes let each reader thread verify the blocks it just read while other reads
    are in flight, instead of one pass over the whole chunk after its last read.
    """
    view = memoryview(payload).cast("B")
    return tuple(hash64(view[i : i + block]) for i in range(0, len(view), block))


def encode_header(header: ChunkHeader) -> bytes:
    """The 4096-byte header block; ValueError when the metadata does not fit."""
    meta = json.dumps(
        {
            "key": header.key, "shape": list(header.shape), "dtype": header.dtype,
            "fmt": header.fmt, "cached_positions": header.cached_positions,
            "geometry": header.geometry, "layout": header.layout,
            "hashes": base64.b64encode(
                struct.pack(f"<{len(header.hashes)}Q", *header.hashes)).decode(),
        },
        separators=(",", ":"),
    ).encode()
    if _FIXED.size + len(meta) > HEADER_SIZE:
        raise ValueError(f"chunk metadata of {len(meta)} bytes does not fit the 4 KiB header")
    head = struct.pack("<8sIIQII", MAGIC, VERSION, len(meta), header.payload_len,
                       header.hash_block, 0)
    block = head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head + meta)) + meta
    return block + b"\0" * (HEADER_SIZE - len(block))


def decode_header(block: bytes, file_size: int) -> ChunkHeader:
    """Parse and check a header block against the file's size; raises only CorruptChunk."""
    if len(block) < _FIXED.size:
        raise CorruptChunk("truncated", f"{len(block)} header bytes")
    magic, version, meta_len, payload_len, hash_block, _, header_hash = _FIXED.unpack_from(block)
    if magic != MAGIC:
        raise CorruptChunk("foreign", "not a kvscope chunk file (bad magic)")
    if version != VERSION:
        raise CorruptChunk("format_version", f"format version {version}, this kvscope reads "
                           f"{VERSION}")
    if _FIXED.size + meta_len > min(len(block), HEADER_SIZE):
        raise CorruptChunk("corrupt_header", f"metadata length {meta_len}")
    meta = block[_FIXED.size : _FIXED.size + meta_len]
    if xxhash.xxh3_64_intdigest(block[:_HASHED] + meta) != header_hash:
        raise CorruptChunk("corrupt_header", "header checksum mismatch")
    if file_size < file_size_for(payload_len):
        raise CorruptChunk("truncated", f"{file_size} bytes, expected {file_size_for(payload_len)}")
    try:
        header = _header_from_meta(json.loads(meta), payload_len, hash_block)
    except (ValueError, TypeError, KeyError, AttributeError, struct.error, binascii.Error,
            RecursionError) as exc:
        raise CorruptChunk("corrupt_header", f"metadata: {type(exc).__name__}: {exc}") from None
    return header


def _header_from_meta(data: Any, payload_len: int, hash_block: int) -> ChunkHeader:
    """Every metadata field checked (type, range, agreement); ValueError/TypeError if not."""
    _require(isinstance(data, dict), "metadata is not an object")
    key, dtype, fmt = data["key"], data["dtype"], data["fmt"]
    _require(isinstance(key, str) and 0 < len(key) <= 2048 and key.isprintable(), "key")
    _require(dtype in DTYPE_SIZES, f"dtype {dtype!r}")
    _require(fmt in FORMATS, f"fmt {fmt!r}")
    shape = data["shape"]
    _require(isinstance(shape, list) and 1 <= len(shape) <= 5
             and all(_is_int(d) and 0 < d < _MAX_DIM for d in shape), f"shape {shape!r}")
    _require(math.prod(shape) * DTYPE_SIZES[dtype] == payload_len,
             f"shape {shape} x {dtype} is not {payload_len} bytes")
    _require(payload_len > 0 and hash_block > 0 and hash_block % ALIGN == 0, "hash block")
    packed = base64.b64decode(data["hashes"], validate=True)
    _require(len(packed) % 8 == 0, "hash list length")
    hashes = struct.unpack(f"<{len(packed) // 8}Q", packed)
    _require(len(hashes) == -(-payload_len // hash_block),
             f"{len(hashes)} hashes for {payload_len} bytes")
    positions = data.get("cached_positions")
    _require(positions is None or (isinstance(positions, list)
                                   and all(_is_int(p) and p >= 0 for p in positions)),
             "cached_positions")
    geometry, layout = data.get("geometry") or {}, data.get("layout") or {}
    _require(isinstance(geometry, dict) and isinstance(layout, dict), "geometry / layout")
    return ChunkHeader(key=key, shape=tuple(shape), dtype=dtype, fmt=fmt,
                       payload_len=payload_len, hash_block=hash_block, hashes=hashes,
                       cached_positions=positions, geometry=geometry, layout=layout)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"invalid {what}")


def read_header(path: str) -> tuple[ChunkHeader, os.stat_result]:
    """Header and stat of a chunk file (start-up scan; buffered, 4 KiB, never via a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        return decode_header(os.pread(fd, HEADER_SIZE, 0), st.st_size), st
    finally:
        os.close(fd)


def temp_name(name: str) -> str:
    """Temporary name of a chunk being written by this process and thread."""
    return f"{TEMP_PREFIX}{name}.{os.getpid()}.{threading.get_native_id()}"


def write_chunk(directory: str, header: ChunkHeader, payload: memoryview) -> tuple[str, os.stat_result]:
    """Durably publish one chunk: write a temp file, fsync, rename, fsync the directory.

    On any OSError (ENOSPC, EIO, ...) the temp file is removed and the error re-raised; the
    final name is never left half-written.
    """
    name = file_name(header.key)
    final = os.path.join(directory, name)
    temp = os.path.join(directory, temp_name(name))
    pad = b"\0" * (padded(header.payload_len) - header.payload_len)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
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
