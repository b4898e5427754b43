"""`kvscope record` around a user's own vLLM server: the TTFT breakdown of traffic kvscope
did not send, on a server kvscope did not start.

The server runs on the LMCache configuration docs/gpu-host.md shows, as written but for
`kvscope.path` (a test directory), so that configuration is tested too.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kvscope.testkit.tracing import read_until
from kvscope.testkit.user_server import complete, tiny_prompts, user_server

from kvscope import analysis
from kvscope.contract import rundir
from kvscope.capture.workload import system
from kvscope.capture.workload.runner import expected_chunks, wait_for_stores

pytestmark = [pytest.mark.live, pytest.mark.root]
READY = "kvscope record: recording"
DOC = Path(__file__).parents[2] / "docs" / "gpu-host.md"
PROBE_MODES = ("per-io", "aggregate")


def _docs_lmcache_yaml(kv_dir: Path, target: Path) -> Path:
    """docs/gpu-host.md section 3's lmcache.yaml with only kvscope.path changed."""
    text = DOC.read_text()
    block = re.search(r"```yaml\n(.*?)```", text[text.index("## 3. A real model, by hand"):],
                      re.S)
    assert block, f"no lmcache.yaml in section 3 of {DOC}"
    config = yaml.safe_load(block.group(1))
    config["extra_config"]["kvscope.path"] = str(kv_dir)
    target.write_text(yaml.safe_dump(config))
    return target


def _record(server, run: Path, probe_mode: str, prompts: list[list[int]]) -> tuple[dict, str]:
    """One recording around a cold pass over `prompts`: client times by response id, stderr."""
    system.drop_page_cache()
    recorder = subprocess.Popen(
        [sys.executable, "-m", "kvscope.cli", "record", "--url", server.base_url, "--out",
         str(run), "--probe-mode", probe_mode],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    read_until(recorder, READY)
    client = {}
    for prompt in prompts:
        sent = time.monotonic()
        rid = complete(server, prompt, max_tokens=1)["id"]
        client[rid] = time.monotonic() - sent
    time.sleep(1.0)
    recorder.send_signal(signal.SIGINT)
    _, err = recorder.communicate(timeout=120)
    assert recorder.returncode == 0, err
    return client, err


def test_record_a_users_server_then_analyze_every_request(tmp_path):
    prompts = tiny_prompts(4, seed=21)
    kv = tmp_path / "kv"
    env = {"KVSCOPE_TRACING": "1", "KVSCOPE_SPANS_DIR": str(tmp_path / "server-spans"),
           "LMCACHE_CONFIG_FILE": str(_docs_lmcache_yaml(kv, tmp_path / "lmcache.yaml"))}
    recorded = {}
    with user_server(tmp_path / "server", env=env) as server:
        for prompt in prompts:
            complete(server, prompt, max_tokens=1)  # stored before the recordings
        assert wait_for_stores(kv, expected_chunks(prompts)) == expected_chunks(prompts), (
            "the documented configuration gives a disk tier")
        for mode in PROBE_MODES:
            recorded[mode] = _record(server, tmp_path / mode, mode, prompts)
        log = server.config.log_path.read_text(errors="replace")
    assert "Failed to create backend" not in log
    for mode, (client, err) in recorded.items():
        _assert_recording(tmp_path / mode, mode, client, err, len(prompts))


def _assert_recording(run: Path, probe_mode: str, client: dict[str, float], err: str,
                      requests: int) -> None:
    assert "missing" not in err, err
    assert rundir.validate(run) == []
    loaded = analysis.load_run(run)
    attribution = analysis.attribute(loaded)
    assert len(attribution) == requests, "every request of the recording is a row"
    assert set(attribution["window"]) == {"server"}
    parts = [f"{c}_ns" for c in analysis.attribution.COMPONENTS]
    assert (attribution[parts].sum(axis=1) == attribution["ttft_ns"]).all()
    assert (attribution["storage_read_ns"] > 0).all(), "the cold hits were read from disk"
    assert (attribution["block_io_count"] > 0).all(), "the worker's reads joined to its spans"
    manifest = rundir.read_manifest(run)
    assert set(loaded.block_io["pid"]) <= set(manifest["server"]["pids"])
    assert len(loaded.block_io) > 0 and manifest["probes"]["probe_mode"] == probe_mode

    rows = loaded.requests.set_index("request_id")
    gaps = [seconds - rows.loc[rid.removeprefix("cmpl-"), "ttft_s"]
            for rid, seconds in client.items()]
    assert min(gaps) >= 0, "the server's TTFT is inside what the client waited"
    print(f"\n{probe_mode}: client - server TTFT {min(gaps) * 1e3:.1f} to "
          f"{max(gaps) * 1e3:.1f} ms")

    analyzed = subprocess.run([sys.executable, "-m", "kvscope.cli", "analyze", str(run),
                               "--no-plots"], capture_output=True, text=True, timeout=600)
    assert analyzed.returncode == 0, analyzed.stderr
    assert f"{requests} requests" in analyzed.stdout
