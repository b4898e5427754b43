"""Issue 19: `kvscope record`, often run as root, takes from the recorded server only what that
server's user wrote, bounded, and hands the run to the user who ran sudo.

The attacker is a real second user (uid 65534). The recorded "server" is this test process with
a stand-in of vLLM's HTTP answers (the trust decisions need its uid, environment and answers,
not a model); the live test (tests/capture/test_shared_host_live.py) records a real vLLM.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from kvscope.analysis import spanstream
from kvscope.capture.record import otlp_receiver, recording
from kvscope.capture.record.server_processes import ServingProcesses
from kvscope.cli import main
from kvscope.contract import otlp_json, rundir, spantable
from kvscope.contract.env import ENV_BACKEND_STATS_DIR, ENV_SPANS_DIR, ENV_TRACING
from kvscope.testkit import span_replay
from kvscope.tracer.fileexport import OtlpJsonFileExporter

pytestmark = [pytest.mark.root]
ROOT = Path(__file__).parents[2]
METRICS = (b"# TYPE vllm:time_to_first_token_seconds histogram\n"
           b"vllm:time_to_first_token_seconds_count 3.0\nvllm:time_to_first_token_seconds_sum "
           b"0.5\n")
MODELS = json.dumps({"data": [{"id": "tiny", "root": "/models/tiny"}]}).encode()
SPAN_FILE = json.dumps({"resourceSpans": []})


def _endless(handler: http.server.BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.end_headers()
    chunk = b"#" * 65536
    try:
        while True:
            handler.wfile.write(chunk)
    except OSError:
        return


@contextmanager
def standin(answers: dict[str, bytes | Callable]) -> Iterator[str]:
    """vLLM's /metrics and /v1/models as `answers` says (bytes, or a handler of its own)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            answer = answers.get(self.path, b"")
            if callable(answer):
                return answer(self)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def _server(environ: dict[str, str]) -> ServingProcesses:
    """This process as the recorded server: root, its environment as given."""
    return ServingProcesses(os.getpid(), (os.getpid(),), {ENV_TRACING: "1", **environ}, (), 0)


def _record(server: ServingProcesses, url: str, out: Path, during=lambda: None,
            **options) -> recording.Recording:
    stop = threading.Event()

    def progress(line: str) -> None:
        if "recording (" in line:
            during()  # files written after the recording started are the ones copied

    opts = recording.RecordOptions(out=out, url=url, duration_s=0.2, probes=False, **options)
    return recording.record(server, opts, stop, progress)


def test_span_files_come_only_from_a_directory_private_to_the_servers_user(
        shared_tmp, as_nobody, tmp_path):
    """Before: a planted link to a 0644 file in a root-only directory was copied into the
    recording (world-readable), a link to /dev/zero made root write until ulimit -f."""
    secret_dir = tmp_path / "root-only"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "secret.json").write_text('{"password": "x"}')
    (secret_dir / "secret.json").chmod(0o644)
    spans = shared_tmp / "kvscope-spans"
    as_nobody("mkdir", "-m", "777", str(spans))

    def plant():
        as_nobody("ln", "-s", str(secret_dir / "secret.json"), str(spans / "client-1-00000.json"))
        as_nobody("ln", "-s", "/dev/zero", str(spans / "vllm-2-00000.json"))
        as_nobody("sh", "-c", f"echo '{SPAN_FILE}' > {spans}/vllm-3-00000.json")

    with standin({"/metrics": METRICS, "/v1/models": MODELS}) as url:
        done = _record(_server({ENV_SPANS_DIR: str(spans)}), url, tmp_path / "run", plant)
    assert list((done.run / "spans").glob("*.json")) == []
    (line,) = [m for m in done.missing if m.startswith("spans:")]
    assert f"nothing copied from {spans}" in line and "uid 65534" in line
    assert rundir.read_manifest(done.run)["recording"]["missing"] == done.missing


def test_from_a_private_directory_only_regular_files_of_the_servers_user(tmp_path):
    spans = tmp_path / "spans"
    spans.mkdir(mode=0o700)
    (tmp_path / "elsewhere.json").write_text(SPAN_FILE)

    def write():
        (spans / "vllm-1-00000.json").write_text(SPAN_FILE)
        (spans / "vllm-1-00001.json").symlink_to(tmp_path / "elsewhere.json")
        (spans / "vllm-1-00002.json").symlink_to("/dev/zero")
        os.mkfifo(spans / "vllm-1-00003.json")
        (spans / "vllm-1-00004.json").write_text(SPAN_FILE)
        os.chown(spans / "vllm-1-00004.json", 65534, 65534)

    with standin({"/metrics": METRICS, "/v1/models": MODELS}) as url:
        done = _record(_server({ENV_SPANS_DIR: str(spans)}), url, tmp_path / "run", write)
    assert sorted(p.name for p in (done.run / "spans").glob("*.json")) == ["vllm-1-00000.json"]
    (line,) = [m for m in done.missing if m.startswith("spans:")]
    assert "4 files not copied" in line and "uid 0" in line


def test_the_tracers_parts_come_along_when_they_are_the_servers_users(tmp_path):
    """A part of the server's user is copied beside its span file (the run loads without
    parsing that file); one of another user stays behind at no cost but that parsing."""
    spans = tmp_path / "spans"
    spans.mkdir(mode=0o700)
    recorded = ROOT / "tests" / "capture" / "data" / "live-tiny-kvscope" / "spans"
    (first, *_) = sorted(recorded.glob("*.json"))
    batch = span_replay.sdk_spans(otlp_json.loads(first.read_bytes()))

    def write():
        exporter = OtlpJsonFileExporter(spans, "vllm")
        exporter.export(batch[:5])
        exporter.export(batch[5:])
        os.chown(spantable.part_of(sorted(spans.glob("*.json"))[1]), 65534, 65534)

    with standin({"/metrics": METRICS, "/v1/models": MODELS}) as url:
        done = _record(_server({ENV_SPANS_DIR: str(spans)}), url, tmp_path / "run", write)
    copied = sorted((done.run / "spans").glob("*.json"))
    assert [spanstream.part_rows(f, f.read_bytes(), 0) is not None for f in copied] == [
        True, False]
    assert not [m for m in done.missing if m.startswith("spans:")]


def test_copying_stops_at_the_caps_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(recording, "MAX_SPAN_FILES", 2)
    monkeypatch.setattr(recording, "MAX_SPAN_FILE_BYTES", 100)
    spans = tmp_path / "spans"
    spans.mkdir(mode=0o700)

    def write():
        (spans / "vllm-1-00000.json").write_text(SPAN_FILE)
        (spans / "vllm-1-00001.json").write_text(" " * 101)  # over the per-file cap
        for n in (2, 3, 4):
            (spans / f"vllm-1-0000{n}.json").write_text(SPAN_FILE)

    with standin({"/metrics": METRICS, "/v1/models": MODELS}) as url:
        done = _record(_server({ENV_SPANS_DIR: str(spans)}), url, tmp_path / "run", write)
    assert sorted(p.name for p in (done.run / "spans").glob("*.json")) == [
        "vllm-1-00000.json", "vllm-1-00002.json"]
    notes = "\n".join(done.missing)
    assert "1 files not copied" in notes and "101 bytes, over the 100-byte cap" in notes
    assert "copying stopped at 2 files" in notes


def test_hostile_answers_config_and_stats_cost_a_line_each_not_the_recording(tmp_path):
    """Before: LMCACHE_CONFIG_FILE=/dev/zero was a MemoryError, a YAML list an AttributeError,
    an endless /metrics or /v1/models a MemoryError, a stats file [1,2] an AttributeError."""
    stats = tmp_path / "backend"
    stats.mkdir(mode=0o700)
    (stats / "1.json").write_text("[1, 2]")
    config = tmp_path / "lmcache.yaml"
    config.write_text("- a\n- list\n")
    answers = {"/metrics": _endless, "/v1/models": b"[1, 2]"}
    with standin(answers) as url:
        done = _record(_server({"LMCACHE_CONFIG_FILE": str(config),
                                ENV_BACKEND_STATS_DIR: str(stats)}), url, tmp_path / "run")
        zero = _record(_server({"LMCACHE_CONFIG_FILE": "/dev/zero"}), url, tmp_path / "run2")
    notes = "\n".join(done.missing)
    assert f"LMCACHE_CONFIG_FILE {config}: holds a YAML list" in notes
    assert "/v1/models could not be read" in notes and "is not of type 'object'" in notes
    assert f"/metrics answered more than {recording.METRICS_MAX_BYTES} bytes" in notes
    assert f"disk backend counters: 1 files refused, e.g. {stats / '1.json'}" in notes
    assert any("LMCACHE_CONFIG_FILE /dev/zero: not read (/dev/zero is not a regular file" in m
               for m in zero.missing)
    assert rundir.validate(done.run) == []


def test_a_busy_otlp_port_is_one_line_and_leaves_no_run(tmp_path, capsys):
    """Before: a traceback after the run directory was made, so a retry found 'already holds a
    run'."""
    with otlp_receiver.OtlpListener("127.0.0.1:0") as busy:
        with standin({"/metrics": METRICS, "/v1/models": MODELS}) as url:
            code = main(["record", "--pid", str(os.getpid()), "--url", url, "--out",
                         str(tmp_path / "run"), "--otlp-listen", f"127.0.0.1:{busy.port}",
                         "--no-probes", "--duration", "0.1"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and err[-1].startswith(f"kvscope record: --otlp-listen 127.0.0.1:{busy.port}")
    assert "Address already in use" in err[-1]
    assert not (tmp_path / "run").exists()


def _export(port: int, request: trace_service_pb2.ExportTraceServiceRequest) -> grpc.StatusCode:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=60)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def _request(spans: int = 1, attributes: int = 0) -> trace_service_pb2.ExportTraceServiceRequest:
    span = trace_pb2.Span(trace_id=b"\1" * 16, span_id=b"\2" * 8, name="kvscope.queue")
    span.attributes.extend([common_pb2.KeyValue(key="k")] * attributes)
    return trace_service_pb2.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
        scope_spans=[trace_pb2.ScopeSpans(spans=[span] * spans)])])


def test_the_otlp_receiver_is_bounded(tmp_path):
    """Before: one 4 MB request of 690k empty attributes took 500 MB and 16-19 s to write an
    18.6 MB file; four workers; no cap on bytes or files."""
    limits = otlp_receiver.Limits(max_bytes=10_000, max_files=2)
    with otlp_receiver.OtlpListener("127.0.0.1:0", limits) as listener:
        receiver = listener.start(tmp_path / "spans")
        assert _export(listener.port, _request(attributes=690_000)) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _export(listener.port, _request(spans=otlp_receiver.MAX_ITEMS + 1)) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        too_big = _request(attributes=otlp_receiver.MAX_ITEMS // 2)
        too_big.resource_spans[0].scope_spans[0].spans[0].name = "x" * (5 << 20)
        assert _export(listener.port, too_big) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _export(listener.port, _request()) == grpc.StatusCode.OK
        assert _export(listener.port, _request(attributes=1000)) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the bytes left
        assert _export(listener.port, _request()) == grpc.StatusCode.OK
        assert _export(listener.port, _request()) == grpc.StatusCode.RESOURCE_EXHAUSTED  # files
    assert len(list((tmp_path / "spans").glob("*.json"))) == 2 == receiver.files_written
    assert receiver.bytes_written <= limits.max_bytes


MILLION = 1_000_000  # empty items: 2 bytes each on the wire, well under 4 MiB in all
# Where an attribute may sit in a request, each a list of key-values to add one to.
PLACES: dict[str, Callable[[trace_service_pb2.ExportTraceServiceRequest], Any]] = {
    "resource": lambda r: r.resource_spans[0].resource.attributes,
    "scope": lambda r: r.resource_spans[0].scope_spans[0].scope.attributes,
    "span": lambda r: r.resource_spans[0].scope_spans[0].spans[0].attributes,
    "event": lambda r: r.resource_spans[0].scope_spans[0].spans[0].events.add().attributes,
    "link": lambda r: r.resource_spans[0].scope_spans[0].spans[0].links.add(
        trace_id=b"\3" * 16, span_id=b"\4" * 8).attributes,
}


def _array(value: common_pb2.AnyValue, items: int) -> common_pb2.AnyValue:
    value.array_value.values.extend([common_pb2.AnyValue()] * items)
    return value


def _kvlist(value: common_pb2.AnyValue, items: int) -> common_pb2.AnyValue:
    value.kvlist_value.values.extend([common_pb2.KeyValue()] * items)
    return value


def _nest(value: common_pb2.AnyValue, levels: int) -> common_pb2.AnyValue:
    """The value `levels` arrays and key-value lists deep, alternately, inside `value`."""
    for level in range(levels):
        value = (value.array_value.values.add() if level % 2 else
                 value.kvlist_value.values.add(key="k").value)
    return value


def _with_value(place: str, fill: Callable[[common_pb2.AnyValue], object]
                ) -> trace_service_pb2.ExportTraceServiceRequest:
    request = _request()
    fill(PLACES[place](request).add(key="k").value)
    return request


@pytest.mark.parametrize(("place", "fill", "why"), [
    pytest.param("span", lambda v: _array(_nest(v, 1), MILLION), "items", id="array-in-span"),
    pytest.param("resource", lambda v: _kvlist(_nest(v, 2), MILLION), "items",
                 id="kvlist-in-resource"),
    pytest.param("scope", lambda v: _array(v, MILLION), "items", id="array-in-scope"),
    pytest.param("event", lambda v: _kvlist(_nest(v, 3), MILLION), "items",
                 id="kvlist-in-event"),
    pytest.param("link", lambda v: _nest(v, 30).SetInParent(), "deep", id="deep-in-link"),
])
def test_a_value_too_large_or_too_deep_is_refused_before_conversion_wherever_it_is(
        tmp_path, place, fill, why):
    """Before: only the attributes of resources, spans and events were counted, not what their
    values held, nor scope and link attributes: one attribute of a 1M-item array (4 MB) cost
    380-470 MB to convert and write."""
    with otlp_receiver.OtlpListener("127.0.0.1:0") as listener:
        receiver = listener.start(tmp_path / "spans")
        assert _export(listener.port, _with_value(place, fill)) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED
    (reason,) = receiver.refused
    assert ("items of values" if why == "items" else
            f"nested more than {otlp_receiver.MAX_VALUE_DEPTH} arrays") in reason
    assert list((tmp_path / "spans").iterdir()) == [] and receiver.files_written == 0


@pytest.mark.parametrize("place", PLACES)
def test_a_nested_value_within_the_caps_is_received(tmp_path, place):
    def fill(value: common_pb2.AnyValue) -> None:
        _array(_nest(value, otlp_receiver.MAX_VALUE_DEPTH - 1), 1000)

    with otlp_receiver.OtlpListener("127.0.0.1:0") as listener:
        receiver = listener.start(tmp_path / "spans")
        assert _export(listener.port, _with_value(place, fill)) == grpc.StatusCode.OK
    assert receiver.files_written == 1 and not receiver.refused


def test_a_receiver_on_every_address_is_warned_about(tmp_path):
    lines = []
    with standin({"/metrics": METRICS, "/v1/models": MODELS}) as url:
        opts = recording.RecordOptions(out=tmp_path / "run", url=url, duration_s=0.1,
                                       probes=False, otlp_listen="0.0.0.0:0")
        recording.record(_server({}), opts, threading.Event(), lines.append)
    warning = [line for line in lines if "warning" in line]
    assert len(warning) == 1 and "0.0.0.0:0 accepts spans from any host" in warning[0]


def test_under_sudo_the_run_is_handed_to_the_user_who_can_then_analyze_it(
        shared_tmp, as_nobody, monkeypatch, capsys):
    """Before: after `sudo kvscope record --out runs/prod`, `kvscope analyze runs/prod` as the
    user failed with a PermissionError traceback (a root-owned run)."""
    home = shared_tmp / "home"
    as_nobody("mkdir", "-m", "700", str(home))
    out = home / "runs" / "prod"
    monkeypatch.setenv("SUDO_UID", "65534")
    monkeypatch.setenv("SUDO_GID", "65534")
    with standin({"/metrics": METRICS, "/v1/models": MODELS}) as url:
        code = main(["record", "--pid", str(os.getpid()), "--url", url, "--out", str(out),
                     "--no-probes", "--duration", "0.1"])
    assert code == 0, capsys.readouterr().err
    owners = {(p.stat().st_uid, p.stat().st_gid) for p in [out.parent, out, *out.rglob("*")]}
    assert owners == {(65534, 65534)}
    assert oct(out.stat().st_mode & 0o777) == "0o700"
    analyzed = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
         "kvscope.cli", "analyze", str(out), "--no-plots"], cwd=ROOT, capture_output=True,
        text=True, env={**os.environ, "HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1"})
    assert analyzed.returncode == 0, analyzed.stderr
    assert (out / "summary.json").stat().st_uid == 65534
