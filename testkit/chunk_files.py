# SPDX-License-Identifier: Apache-2.0
"""Real chunk files (format 3, per-block XXH3-64) written straight to a directory, for tests of
what reads a directory of chunks without an engine in front of it (the tuner)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from kvscope.patched_backend.parallel_disk.chunkfile import (
    ChunkHeader, block_hashes, hash_block_for, write_chunk)


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
