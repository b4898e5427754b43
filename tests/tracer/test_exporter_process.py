"""The exporter process a traced process starts: it survives being killed (started again, the
loss counted), and it trades spans with nobody but its own user's processes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import pytest
from kvscope.testkit.tracing import wait_until

from kvscope.contract.env import ENV_EXPORTER, ENV_SPANS_DIR
from kvscope.contract import semconv
from kvscope.tracer import config, exporter_link, failsafe, pipeline, runtime, spans
from kvscope.tracer.run import summarize_stats

NOBODY = "65534"
CALLER = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


@pytest.fixture(autouse=True)
def _fresh():
    runtime.reset()
    yield
    runtime.reset()


def _record(rt: runtime.Runtime, count: int) -> None:
    request = spans.RequestTrace.from_headers(CALLER, "cmpl-r-0-0123abcd")
    assert request is not None
    for i in range(count):
        spans.record(rt, semconv.SPAN_QUEUE, request, 1_000 + i, 2_000 + i)


def _pending(spans_dir) -> int:
    path = spans_dir / pipeline.STATS_DIR / f"vllm-{os.getpid()}.json"
    return json.loads(path.read_text())["by_exporter"]["file"]["pending"] if path.exists() else 0


def test_a_killed_exporter_is_started_again_and_what_it_had_taken_is_counted_lost(
        tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_SPANS_DIR, str(tmp_path))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # taken spans wait in its queue
    rt = runtime.get()
    assert rt is not None
    (supervisor,) = exporter_link._supervisor
    first = supervisor.process.pid
    _record(rt, 100)
    assert wait_until(lambda: _pending(tmp_path) == 100, timeout_s=20), "it took every record"
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: supervisor.process.pid != first, timeout_s=20)
    _record(rt, 50)  # while the new one starts: they wait in the ring
    assert wait_until(lambda: _pending(tmp_path) == 50, timeout_s=30), \
        "the new exporter took them, and counts what the dead one had pending as lost"
    runtime.reset()  # the process ends: the new exporter exports the rest
    final = summarize_stats(tmp_path, final=True)
    assert final["hook_errors"] == {"exporter.restart": 1}
    assert final["spans_ended"] == 150
    assert final["by_exporter"]["file"]["exported"] == 50
    assert final["spans_lost"] == 100, "what the killed one had taken and not exported"
    assert ENV_EXPORTER not in os.environ, "a later tracer in this process starts its own"


_CHILD = """
from kvscope.contract import semconv
from kvscope.tracer import runtime, spans
rt = runtime.get()
request = spans.RequestTrace.from_headers(
    {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, "cmpl-c-0-01234567")
for i in range(3):
    spans.record(rt, semconv.SPAN_QUEUE, request, 1_000 + i, 2_000 + i)
runtime.reset()
"""


def test_a_process_that_inherits_another_configurations_exporter_starts_its_own(
        tmp_path, monkeypatch):
    """A server started from a traced process inherits that process's exporter address, not
    its spans directory: its spans go where its own environment says."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    monkeypatch.setenv(ENV_SPANS_DIR, str(ours))
    assert runtime.get() is not None
    inherited = os.environ[ENV_EXPORTER]
    subprocess.run([sys.executable, "-c", _CHILD], env={**os.environ, ENV_SPANS_DIR: str(theirs)},
                   check=True, timeout=120)
    _record(runtime.get(), 2)
    assert os.environ[ENV_EXPORTER] == inherited, "ours is still ours"
    runtime.reset()
    assert summarize_stats(theirs, final=True)["spans_exported"] == {"file": 3}
    assert summarize_stats(ours, final=True)["spans_exported"] == {"file": 2}


_CONNECT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(b"\\0" + sys.argv[1].encode())
try:
    s.sendall(json.dumps({"hello": {"pid": 1, "service": "x", "prefix": "evil",
                                    "offset_ns": 0}}).encode())
    print("closed" if s.recv(10) == b"" else "open")
except OSError as e:  # closed before the greeting was taken
    print("closed", e)
"""


@pytest.mark.root
def test_another_users_process_is_refused_by_the_exporter(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_SPANS_DIR, str(tmp_path))
    rt = runtime.get()
    assert rt is not None
    name = os.environ[ENV_EXPORTER]
    out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                          sys.executable, "-c", _CONNECT, name], capture_output=True, text=True,
                         timeout=30, check=True)
    assert out.stdout.startswith("closed"), out
    _record(rt, 3)
    runtime.reset()
    assert summarize_stats(tmp_path, final=True)["spans_exported"] == {"file": 3}
    assert not list((tmp_path / pipeline.STATS_DIR).glob("evil-*")), "nothing of theirs"


_SQUAT = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(b"\\0" + sys.argv[1].encode())
s.listen(8)
print("bound", flush=True)
while True:
    c, _ = s.accept()
"""


@pytest.mark.root
def test_an_exporter_address_another_user_holds_turns_tracing_off_in_one_line(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(ENV_SPANS_DIR, str(tmp_path))
    name = f"kvscope-squatted-{os.getpid()}-{exporter_link._tag()}"  # what ours would be named
    squatter = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                 "--clear-groups", sys.executable, "-c", _SQUAT, name],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "bound"
        monkeypatch.setenv(ENV_EXPORTER, name)
        failsafe.reset()
        config.reset()
        with caplog.at_level(logging.WARNING, logger="kvscope.tracer.failsafe"):
            assert runtime.get() is None
    finally:
        squatter.kill()
        squatter.wait()
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"@{name} belongs to uid {NOBODY}" in line and "tracing is off" in line
    assert failsafe.counts() == {runtime.BUILD: 1}
    assert not list(tmp_path.glob("*.json")), "no span went anywhere"
    assert exporter_link._supervisor == [], "and no exporter of ours was started"
