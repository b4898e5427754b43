"""`kvscope run` on the tiny twin: a real server, warm then cold, into a valid run directory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvscope import rundir

pytestmark = [pytest.mark.live, pytest.mark.root]

PROMPT_TOKENS = 600  # two full 256-token chunks and a tail that is always recomputed
REQUESTS = 4


def test_warm_then_cold_reads_every_full_chunk_from_disk(twin_dir, free_port, tmp_path):
    twin_dir("tiny")
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "run", "--model", "tiny", "--out", str(run),
         "--requests", str(REQUESTS), "--concurrency", "2", "--prompt-tokens",
         str(PROMPT_TOKENS), "--port", str(free_port), "--kv-dir", str(tmp_path / "kv")],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"run directory: {run}" in proc.stdout

    assert rundir.validate(run) == []
    requests = rundir.read_table(run, "requests")
    assert len(requests) == 2 * REQUESTS
    assert (requests["status"] == "ok").all()
    assert (requests["ttft_s"] > 0).all()
    assert (requests["prompt_tokens"] == PROMPT_TOKENS).all()
    warm = requests[requests["phase"] == "warm"]
    cold = requests[requests["phase"] == "cold"]
    assert (warm["cached_tokens"] == 0).all()
    assert (cold["cached_tokens"] == 512).all(), cold["cached_tokens"].tolist()
    assert sorted(cold["prompt_index"]) == sorted(warm["prompt_index"])

    manifest = rundir.read_manifest(run)
    cold_phase = next(p for p in manifest["phases"] if p["name"] == "cold")
    chunk_bytes = manifest["model"]["kv_bytes_per_chunk"]
    assert cold_phase["page_cache_dropped"]
    assert cold_phase["disk_read_bytes"] >= REQUESTS * 2 * chunk_bytes
    assert cold_phase["vllm"]["vllm:external_prefix_cache_hits_total"] == REQUESTS * 512
    assert manifest["server"]["startup_s"] > 0
    assert not (tmp_path / "kv").exists(), "chunk files are removed unless --keep-kv"

    # The probes ran around each phase and saw the worker read the chunks back from the disk.
    assert manifest["probes"]["mode"] == "bpf", manifest["probes"].get("why_fallback")
    block_io = rundir.read_table(run, "block_io")
    cold_reads = block_io[(block_io["phase"] == "cold") & (block_io["op"] == "R")]
    assert set(cold_reads["pid"]) <= set(manifest["probes"]["pids"])
    assert cold_reads["bytes"].sum() >= REQUESTS * 2 * chunk_bytes
    assert (cold_reads["complete_ns"] >= cold_reads["issue_ns"]).all()
