"""`kvscope run --device twin:<profile>`: a live run whose chunks live on the twin, read cold
through its loop device, which the block probes watch; and no twin left behind after it."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from kvscope.testkit.tracing import free_tcp_port

from kvscope.contract import rundir

START_WAIT_S = 300.0  # a bound on waiting for the run's server to start, not a timed assertion

pytestmark = [pytest.mark.live, pytest.mark.root]


def _twin_traces() -> list[str]:
    """Loop devices over a twin's backing file, and mounts of a twin's folders."""
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    mounts = Path("/proc/mounts").read_text()
    return [line for line in (loops + mounts).splitlines() if "kvscope-twin-" in line]


def _run_on_a_twin(run: Path, *options: str, prompt_tokens: int = 600) -> list[str]:
    """`kvscope run` of the tiny twin on the x4 NVMe-oF twin into `run`, with `options`."""
    return [sys.executable, "-m", "kvscope.cli", "run", "--model", "tiny", "--prompt-tokens",
            str(prompt_tokens), "--device", "twin:nvmeof-tcp-x4", "--port", str(free_tcp_port()),
            "--no-tracing", "--out", str(run), *options]


def test_a_run_on_a_twin_reads_its_chunks_cold_through_the_twins_loop_device(tmp_path):
    assert _twin_traces() == [], "a twin from elsewhere would blur this test"
    run = tmp_path / "run"
    proc = subprocess.run(_run_on_a_twin(run, "--requests", "2", "--concurrency", "1"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = rundir.read_manifest(run)
    device = manifest["device"]
    assert device["kind"] == "twin" and device["name"].startswith("loop")
    assert device["profile"]["name"] == "nvmeof-tcp-x4" and device["stack_latency_us"] > 0
    assert manifest["machine"]["disk_device"] == device["name"]
    cold = next(p for p in manifest["phases"] if p["kind"] == "cold")
    assert cold["chunks_on_disk"] == cold["chunks_expected"] > 0
    assert cold["disk_read_bytes"] > 0, "the chunks were read from the twin, not a cache"
    blocks = rundir.read_table(run, "block_io")
    reads = blocks[(blocks["phase"] == cold["name"]) & (blocks["op"] == "R")]
    assert len(reads) > 0 and set(reads["device"]) == {device["name"]}
    assert _twin_traces() == []


def test_ctrl_c_during_a_run_on_a_twin_leaves_no_twin_behind(tmp_path):
    assert _twin_traces() == [], "a twin from elsewhere would blur this test"
    run = tmp_path / "run"
    driver = subprocess.Popen(
        _run_on_a_twin(run, "--phases", "warm", "--requests", "400", "--no-probes"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + START_WAIT_S
    while not (run / rundir.MANIFEST).exists() and driver.poll() is None:
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.2)
    assert _twin_traces(), "the twin is up while the run is"
    driver.send_signal(signal.SIGINT)
    _, stderr = driver.communicate(timeout=START_WAIT_S)
    assert driver.returncode != 0, stderr[-2000:]
    assert _twin_traces() == []


def _cold_reads(run: Path) -> pd.DataFrame:
    """The block reads of a run's cold phase, in the order they were issued."""
    blocks = rundir.read_table(run, "block_io")
    return blocks[(blocks["phase"] == "cold") & (blocks["op"] == "R")].sort_values("issue_ns")


def _most_in_flight(reads: pd.DataFrame) -> int:
    """The most reads the device held at once (issue to completion)."""
    edges = sorted([(t, 1) for t in reads["issue_ns"]] + [(t, -1) for t in reads["complete_ns"]])
    return max(itertools.accumulate(step for _, step in edges))


def test_on_a_twin_serial_mode_reads_one_128_KiB_read_at_a_time_and_parallel_many(tmp_path):
    """The twin separates the two read paths: kvscope-serial keeps one 128 KiB read at the
    device, kvscope many, so its cold requests read their 15 chunks several times faster."""
    ttft = {}
    for profile in ("kvscope", "kvscope-serial"):
        run = tmp_path / profile
        proc = subprocess.run(_run_on_a_twin(run, "--profile", profile, "--requests", "6",
                                             "--concurrency", "1", "--max-tokens", "1",
                                             prompt_tokens=3840),
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reads = _cold_reads(run)
        assert len(reads) > 0 and reads["bytes"].median() == 128 << 10, reads["bytes"].unique()
        depth = _most_in_flight(reads)
        # serial: one read at a time, which goes out as two requests where the file's blocks
        # change extent inside it; parallel: a request's 15 chunks read together
        assert depth <= 2 if profile == "kvscope-serial" else depth >= 8, (profile, depth)
        requests = rundir.read_table(run, "requests")
        ttft[profile] = requests[requests["phase"] == "cold"]["ttft_s"].median()
    ratio = ttft["kvscope-serial"] / ttft["kvscope"]
    print(f"cold TTFT p50 on twin:nvmeof-tcp-x4: kvscope {ttft['kvscope']:.3f} s, "
          f"kvscope-serial {ttft['kvscope-serial']:.3f} s, {ratio:.2f}x")
    assert ratio > 1.3, ttft  # 2.4-4.1x measured on the 2-vCPU VM; a ratio, not a timing
