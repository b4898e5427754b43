"""`kvscope run` end to end, and a known delay injected into every storage read moves the
attributed storage component by it.

The base run is the command line's: warm then cold into a valid run directory, with the probes
seeing the worker read every full chunk back from the disk. A second run reads the same chunks
cold with KVSCOPE_READ_DELAY_MS=D on the `kvscope-serial` backend: the backend sleeps D before
each read syscall, and serial mode makes them one after another (128 KiB each: 2 per chunk of
the tiny twin), so each request's storage read grows by reads x D and nothing else should. The
delay is large next to the scheduling jitter of a busy 2-core machine (a late wake-up adds a few
ms, never removes any), so every request must move by at least the delay and the median by the
delay within 10%.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvscope import analysis
from kvscope.contract import rundir
from kvscope.capture.workload.options import RunOptions
from kvscope.capture.workload.runner import execute

pytestmark = [pytest.mark.live, pytest.mark.root]

DELAY_MS = 250  # base and slow cold phases run in different servers: room for their noise
REQUESTS = 6
PROMPT_TOKENS = 600  # 2 full chunks per request


def _cold_rows(run):
    loaded = analysis.load_run(run)
    rows = analysis.attribute(loaded)
    rows = rows[(rows["phase"] == "cold") & ~rows["partial"].astype(bool)]
    return loaded, rows.set_index("prompt_index")


def _cli_run(run, port, kv_dir):
    """`kvscope run` as a user types it: warm then cold, chunks kept for the second run."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "run", "--model", "tiny", "--profile",
         "kvscope-serial", "--out", str(run), "--requests", str(REQUESTS), "--concurrency", "1",
         "--prompt-tokens", str(PROMPT_TOKENS), "--port", str(port), "--kv-dir", str(kv_dir),
         "--keep-kv"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"run directory: {run}" in proc.stdout


def _assert_a_valid_run_that_read_every_full_chunk_from_disk(run):
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

    # The probes ran around each phase and saw the worker read the chunks back from the disk.
    assert manifest["probes"]["mode"] == "bpf", manifest["probes"].get("why_fallback")
    block_io = rundir.read_table(run, "block_io")
    cold_reads = block_io[(block_io["phase"] == "cold") & (block_io["op"] == "R")]
    assert set(cold_reads["pid"]) <= set(manifest["probes"]["pids"])
    assert cold_reads["bytes"].sum() >= REQUESTS * 2 * chunk_bytes
    assert (cold_reads["complete_ns"] >= cold_reads["issue_ns"]).all()


def test_a_run_then_an_injected_read_delay_moves_storage_read_by_that_delay(
        twin_dir, free_port, tmp_path):
    twin_dir("tiny")
    kv_dir = tmp_path / "kv"
    _cli_run(tmp_path / "base", free_port, kv_dir)
    _assert_a_valid_run_that_read_every_full_chunk_from_disk(tmp_path / "base")
    _, base = _cold_rows(tmp_path / "base")
    # The slow run reads the chunks the base run's warm phase stored: same files, same prompts.
    slow_run, slow = _cold_rows(execute(RunOptions(
        out=tmp_path / "slow", model="tiny", profile="kvscope-serial", requests=REQUESTS,
        concurrency=[1], prompt_tokens=PROMPT_TOKENS, port=free_port, kv_dir=kv_dir,
        phases=["cold"], extra_env={"KVSCOPE_READ_DELAY_MS": str(DELAY_MS)})))
    assert len(base) == len(slow) == REQUESTS, "every cold request must be fully attributed"

    reads = slow_run.spans[slow_run.spans["name"] == "kvscope.storage.read"]
    sub_reads = reads.groupby("request_id")["attributes"].apply(
        lambda attrs: sum(int(a["kvscope.storage.subreads"]) for a in attrs))
    per_prompt = slow.join(sub_reads.rename("sub_reads"), on="request_id")["sub_reads"]
    assert (per_prompt == 2 * (PROMPT_TOKENS // 256)).all(), per_prompt.tolist()

    expected_ns = per_prompt * DELAY_MS * 1_000_000
    moved = slow["storage_read_ns"] - base["storage_read_ns"]
    assert (slow["storage_read_ns"] >= expected_ns).all(), (slow["storage_read_ns"].tolist(),
                                                             expected_ns.tolist())
    ratio = (moved / expected_ns).median()
    assert ratio == pytest.approx(1.0, abs=0.1), (moved.tolist(), expected_ns.tolist())
    # The sum stays exact, and the delay did not leak into the other components.
    parts = ["queueing_ns", "kv_lookup_ns", "storage_read_ns", "transfer_ns", "prefill_ns",
             "other_ns"]
    assert (slow[parts].sum(axis=1) == slow["ttft_ns"]).all()
    other_moved = (slow["ttft_ns"] - base["ttft_ns"] - moved).abs().median()
    assert other_moved < 0.5 * DELAY_MS * 1_000_000
