# SPDX-License-Identifier: Apache-2.0
"""Live (vLLM-CPU + LMCache + the kvscope profile): restart, then a true cold start at depth.

One warm server stores every prompt's chunks and stops; a new server finds them on disk only
(page cache dropped) and serves 64 concurrent requests from them: no deadlock, all succeed,
every stored chunk is a hit.
"""

import pytest

from kvscope.contract import rundir
from kvscope.testkit.live_backend import chunk_files, chunks_found_at_start, hit_chunks, kvscope_run, verify_file

pytestmark = [pytest.mark.live, pytest.mark.root]

REQUESTS = 64
PROMPT_TOKENS = 512  # two full chunks per prompt


def test_restart_then_64_concurrent_cold_requests_all_hit(free_port, tmp_path):
    kv = tmp_path / "kv"
    # Warm at concurrency 1: every prompt is prefilled in one step, so both chunks are stored;
    # --keep-kv makes the driver wait for the asynchronous writes before it stops the server
    # (vLLM kills its worker at shutdown: queued writes would be lost).
    first = kvscope_run(tmp_path / "warm", kv, free_port, "--model", "tiny",
                        "--phases", "warm", "--requests", str(REQUESTS),
                        "--concurrency", "1", "--prompt-tokens", str(PROMPT_TOKENS))
    warm = first[first["phase"] == "warm"]
    assert (warm["status"] == "ok").all() and (warm["cached_tokens"] == 0).all()
    stored = chunk_files(kv)
    assert len(stored) == 2 * REQUESTS
    for path in stored:
        verify_file(path)

    cold = kvscope_run(tmp_path / "cold", kv, free_port, "--model", "tiny", "--phases", "cold",
                       "--requests", str(REQUESTS), "--concurrency", str(REQUESTS),
                       "--prompt-tokens", str(PROMPT_TOKENS))

    assert chunks_found_at_start(tmp_path / "cold") == 2 * REQUESTS
    assert len(cold) == REQUESTS and (cold["status"] == "ok").all(), cold["error"].tolist()
    assert (cold["concurrency"] == REQUESTS).all()
    assert (hit_chunks(cold) == 2).all(), cold["cached_tokens"].tolist()
    assert sorted(cold["prompt_index"]) == sorted(warm["prompt_index"])
    # the backend's own counters reach the manifest in a run without tracing
    counters = rundir.read_manifest(tmp_path / "cold")["disk_backend"]["by_phase"]["cold"]
    assert counters["read_hits"] == 2 * REQUESTS and counters["corrupt_chunks"] == 0
