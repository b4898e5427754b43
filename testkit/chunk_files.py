# SPDX-License-Identifier: Apache-2.0
"""Real chunk files (format 3, per-block XXH3-64) written straight to a directory, for tests of
what reads a directory of chunks without an engine in front of it (the tuner)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from kvscope.patched_backend.parallel_disk.chunkfile import (
    ChunkHeader, block_hashes, encode_header, file_name, file_size_for, hash_block_for,
    write_chunk)


def write_chunks(directory: Path, count: int, shape: tuple[int, ...]) -> list[Path]:
    """``count`` bf16 chunks of ``shape`` (one random payload, keys differ), published as the
    backend publishes them (temp file, fsync, rename)."""
    payload_len = math.prod(shape) * 2
    payload = memoryview(os.urandom(payload_len))
    block = hash_block_for(payload_len)
    hashes = block_hashes(payload, block)
    return [Path(write_chunk(str(directory), ChunkHeader(
        key=f"kvscope-test@{i}", shape=shape, dtype="torch.bfloat16", fmt="KV_2LTD",
        payload_len=payload_len, hash_block=block, hashes=hashes), payload)[0])
        for i in range(count)]


def write_hollow_chunk(directory: Path, shape: tuple[int, ...]) -> Path:
    """A chunk file whose real header claims a bf16 payload of ``shape`` that the file holds
    only as a hole (truncated to its full size, sparse): a header may claim gigabytes at no
    cost on disk."""
    payload_len = math.prod(shape) * 2
    block = hash_block_for(payload_len)
    header = ChunkHeader(key="kvscope-test@hollow", shape=shape, dtype="torch.bfloat16",
                         fmt="KV_2LTD", payload_len=payload_len, hash_block=block,
                         hashes=(0,) * -(-payload_len // block))
    path = directory / file_name(header.key)
    path.write_bytes(encode_header(header))
    os.truncate(path, file_size_for(payload_len))
    return path
