"""Issue 19, live: a vLLM server started by hand as root whose spans directory another user
(uid 65534) prepared, with links to root-only files and fake span files planted in it.

Before: the server wrote its span and stats files into that directory (readable by them,
through their links: root-only files overwritten with span JSON), and `sudo kvscope record`
copied their fake spans and what their links pointed to into the recording. Now every request
is served, root creates nothing there, each traced process says why in one log line, and the
recording copies nothing from it. One server start (about 45 s on two idle cores) for it all.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from kvscope.testkit.tracing import read_until
from kvscope.testkit.user_server import complete, tiny_prompts, user_server

from kvscope.contract import rundir

pytestmark = [pytest.mark.live, pytest.mark.root]
READY = "kvscope record: recording"
HOSTILE_ID = '<a href="https://evil.example/">x</a>'  # a client chooses its X-Request-Id


def _listing(directory) -> dict[str, tuple[int, int]]:
    return {p.name: (p.lstat().st_ino, p.lstat().st_uid) for p in directory.iterdir()}


def test_a_root_server_and_its_recording_use_nothing_another_user_prepared(
        shared_tmp, as_nobody, tmp_path):
    secret_dir = tmp_path / "root-only"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "token.json"
    secret.write_text('{"token": "root only"}')
    secret.chmod(0o644)
    spans = shared_tmp / "kvscope-spans"  # where the docs used to say to put it
    as_nobody("mkdir", "-m", "777", str(spans))
    as_nobody("ln", "-s", str(secret_dir), str(spans / "stats"))
    as_nobody("ln", "-s", str(secret), str(spans / "client-1-00000.json"))
    as_nobody("ln", "-s", "/dev/zero", str(spans / "vllm-1-00000.json"))
    as_nobody("sh", "-c", f"echo '{json.dumps({'resourceSpans': []})}' > {spans}/vllm-2-00000.json")
    planted = _listing(spans)
    run = tmp_path / "run"
    with user_server(tmp_path / "server", env={"KVSCOPE_TRACING": "1",
                                               "KVSCOPE_SPANS_DIR": str(spans)}) as server:
        recorder = subprocess.Popen(
            [sys.executable, "-m", "kvscope.cli", "record", "--url", server.base_url, "--out",
             str(run), "--no-probes"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        seen = read_until(recorder, READY)
        prompts = tiny_prompts(2, seed=19)
        answers = [complete(server, prompts[0], max_tokens=2),
                   complete(server, prompts[1], max_tokens=2,
                            headers={"X-Request-Id": HOSTILE_ID})]
        time.sleep(1.0)  # past the tracer's file flush: it would have written by now
        recorder.send_signal(signal.SIGINT)
        _, rest = recorder.communicate(timeout=120)
        err = "".join(seen) + rest
        log = server.config.log_path.read_text(errors="replace")
    assert all(len(a["choices"][0]["logprobs"]["tokens"]) == 2 for a in answers), answers
    assert _listing(spans) == planted, "root created, removed or replaced nothing there"
    assert secret.read_text() == '{"token": "root only"}' and os.listdir(secret_dir) == [
        "token.json"]
    refusals = [line for line in log.splitlines() if "KVSCOPE_SPANS_DIR=" in line]
    pids = {re.search(r"\(pid (\d+)\)", line).group(1) for line in refusals}
    assert len(pids) >= 2 and len(refusals) == len(pids), refusals  # one line per process
    for line in refusals:
        assert str(spans) in line and "owned by uid 65534" in line and "mode 0777" in line
        assert "file export off; serving goes on" in line
    assert "Traceback" not in log
    assert recorder.returncode == 0, err
    assert [p for p in run.rglob("*.json") if p.parent != run] == []
    missing = rundir.read_manifest(run)["recording"]["missing"]
    assert any(m.startswith(f"spans: nothing copied from {spans}") and "uid 65534" in m
               for m in missing), missing
    assert f"missing: spans: nothing copied from {spans}" in err
