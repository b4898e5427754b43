"""`kvscope record` around a user's own vLLM server: the TTFT breakdown of traffic kvscope
did not send, on a server kvscope did not start."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tracer_testkit import read_until
from user_server import complete, tiny_prompts, user_server

import analysis
from kvscope import rundir
from kvscope.workload import system
from kvscope.workload.runner import expected_chunks, wait_for_stores

pytestmark = [pytest.mark.live, pytest.mark.root]
READY = "kvscope record: recording"


def _start_record(args: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kvscope.cli", "record", *args],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    read_until(proc, READY)
    return proc


@pytest.mark.parametrize("probe_mode", ["per-io", "aggregate"])
def test_record_a_users_server_then_analyze_every_request(tmp_path, probe_mode):
    prompts = tiny_prompts(4, seed=21)
    run = tmp_path / "run"
    env = {"KVSCOPE_TRACING": "1", "KVSCOPE_SPANS_DIR": str(tmp_path / "server-spans")}
    with user_server(tmp_path, env=env) as server:
        for prompt in prompts:
            complete(server, prompt, max_tokens=1)  # stored before the recording
        wait_for_stores(tmp_path / "kv", expected_chunks(prompts))
        system.drop_page_cache()
        recorder = _start_record(["--url", server.base_url, "--out", str(run),
                                  "--probe-mode", probe_mode])
        client = {}
        for prompt in prompts:
            sent = time.monotonic()
            rid = complete(server, prompt, max_tokens=1)["id"]
            client[rid] = time.monotonic() - sent
        time.sleep(1.0)
        recorder.send_signal(signal.SIGINT)
        out, err = recorder.communicate(timeout=120)
        assert recorder.returncode == 0, err
    assert "missing" not in err, err
    assert rundir.validate(run) == []

    loaded = analysis.load_run(run)
    attribution = analysis.attribute(loaded)
    assert len(attribution) == len(prompts), "every request of the recording is a row"
    assert set(attribution["window"]) == {"server"}
    parts = [f"{c}_ns" for c in analysis.attribution.COMPONENTS]
    assert (attribution[parts].sum(axis=1) == attribution["ttft_ns"]).all()
    assert (attribution["storage_read_ns"] > 0).all(), "the cold hits were read from disk"
    assert (attribution["block_io_count"] > 0).all(), "the worker's reads joined to its spans"
    pids = set(rundir.read_manifest(run)["server"]["pids"])
    assert set(loaded.block_io["pid"]) <= pids and len(loaded.block_io) > 0
    assert rundir.read_manifest(run)["probes"]["probe_mode"] == probe_mode

    requests = loaded.requests.set_index("trace_id")
    for rid, seconds in client.items():
        row = requests[requests["request_id"] == rid.removeprefix("cmpl-")].iloc[0]
        assert row["ttft_s"] <= seconds, "the server's TTFT is inside what the client waited"
    gaps = [seconds - requests[requests["request_id"] == rid.removeprefix("cmpl-")]
            .iloc[0]["ttft_s"] for rid, seconds in client.items()]
    print(f"\nclient - server TTFT: {min(gaps) * 1e3:.1f} to {max(gaps) * 1e3:.1f} ms")

    analyzed = subprocess.run([sys.executable, "-m", "kvscope.cli", "analyze", str(run),
                               "--no-plots"], capture_output=True, text=True, timeout=600)
    assert analyzed.returncode == 0, analyzed.stderr
    assert f"{len(prompts)} requests" in analyzed.stdout
