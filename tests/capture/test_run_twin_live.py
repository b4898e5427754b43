"""`kvscope run --device twin:<profile>`: a live run whose chunks live on the twin, read cold
through its loop device, which the block probes watch; and no twin left behind after it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

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


def _run_on_a_twin(run: Path, *options: str) -> list[str]:
    """`kvscope run` of the tiny twin on the x4 NVMe-oF twin into `run`, with `options`."""
    return [sys.executable, "-m", "kvscope.cli", "run", "--model", "tiny", "--prompt-tokens",
            "600", "--device", "twin:nvmeof-tcp-x4", "--port", str(free_tcp_port()),
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
