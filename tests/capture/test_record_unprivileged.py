"""`kvscope record` without root: everything but the probes, and one line saying why.

The recorded server is a stand-in for vLLM (an HTTP server with vLLM's /metrics and /v1/models
answers, traced into a span directory), because a real one cannot run as an unprivileged user
here (the model and the venv's caches belong to root); `kvscope record` itself runs as `nobody`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from kvscope.testkit.tracing import free_tcp_port, read_until

from kvscope.contract import rundir

pytestmark = [pytest.mark.root]
NOBODY = 65534
ROOT = Path(__file__).parents[2]
STANDIN = """
import http.server, json, sys
class Vllm(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (b"# TYPE vllm:time_to_first_token_seconds histogram\\n"
                b"vllm:time_to_first_token_seconds_count 3.0\\n"
                b"vllm:time_to_first_token_seconds_sum 0.5\\n") if self.path == "/metrics" \\
            else json.dumps({"data": [{"id": "tiny", "root": "/models/tiny"}]}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Vllm).serve_forever()
"""


def _as_nobody(argv: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                             "--clear-groups", *argv], **kwargs)


@pytest.fixture
def home():
    """A home directory of `nobody` (0700) under a root-owned 0755 directory."""
    base = Path(tempfile.mkdtemp(prefix="kvscope-unprivileged-"))
    base.chmod(0o755)
    path = base / "home"
    path.mkdir(mode=0o700)
    os.chown(path, NOBODY, NOBODY)
    yield path
    shutil.rmtree(base, ignore_errors=True)


def test_record_without_root_writes_a_valid_run_and_says_why_probes_are_missing(home):
    spans = home / "spans"  # the server's, private to its user (contract.files)
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    "mkdir", "-m", "700", str(spans)], check=True)
    port = free_tcp_port()
    env = {**os.environ, "KVSCOPE_TRACING": "1", "KVSCOPE_SPANS_DIR": str(spans),
           "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(home)}
    server = _as_nobody([sys.executable, "-c", STANDIN, str(port)], env=env)
    try:
        time.sleep(1.0)
        run = home / "run"
        recorder = _as_nobody([sys.executable, "-m", "kvscope.cli", "record", "--pid",
                               str(server.pid), "--url", f"http://127.0.0.1:{port}", "--out",
                               str(run), "--duration", "3"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = read_until(recorder, "kvscope record: recording")  # files from now on count
        _as_nobody([sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
                    str(spans / "vllm-1-00000.json"), json.dumps({"resourceSpans": []})],
                   env=env).wait()
        out, rest = recorder.communicate(timeout=120)
        err = "".join(seen) + rest
    finally:
        server.kill()
        server.wait()
    assert recorder.returncode == 0, err
    assert "missing: probes: not root" in err
    assert rundir.validate(run) == []
    manifest = rundir.read_manifest(run)
    assert manifest["model"]["name"] == "tiny"
    assert manifest["phases"][0]["vllm"]["vllm:time_to_first_token_seconds_count"] == 0
    assert not (run / "block_io.parquet").exists()
    assert (run / "spans" / "vllm-1-00000.json").exists(), "span files of the recording copied"
