"""`kvscope import`: trace files in the formats backends write, and Jaeger's OTLP query API,
become run directories that `kvscope analyze` splits exactly; bad input is named."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvscope import analysis
from kvscope.capture.trace_import import documents
from kvscope.capture.trace_import.jaeger import MAX_TIME_US
from kvscope.cli import main
from kvscope.contract import otlp_json, semconv
from kvscope.testkit import jaeger_forms
from kvscope.tracer.fileexport import OtlpJsonFileExporter

MS = 1_000_000
T0 = 1_764_000_000_000 * MS  # an epoch-ns moment
REQUESTS = 3
# (name, start ms, end ms) within one request, relative to its arrival
CHILDREN = ((semconv.SPAN_QUEUE, 2, 30), (semconv.SPAN_KV_LOOKUP, 30, 31),
            (semconv.SPAN_STORAGE_READ, 35, 95), (semconv.SPAN_PREFILL, 100, 160))
TTFT_S = 0.2


def _write_sdk_spans(directory: Path) -> None:
    """REQUESTS traced requests through the OpenTelemetry SDK and kvscope's OTLP JSON exporter."""
    provider = TracerProvider(resource=Resource.create({"service.name": "kvscope-vllm",
                                                        "process.pid": 4242}))
    provider.add_span_processor(SimpleSpanProcessor(OtlpJsonFileExporter(directory, "vllm")))
    tracer = provider.get_tracer("test")
    for n in range(REQUESTS):
        arrival = T0 + n * 1000 * MS
        rid = f"req-{n}"
        server = tracer.start_span(semconv.SPAN_SERVER_REQUEST, start_time=arrival,
                                   kind=trace.SpanKind.SERVER, attributes={
                                       semconv.REQUEST_ID: rid, semconv.GEN_AI_TTFT: TTFT_S,
                                       semconv.GEN_AI_PROMPT_TOKENS: 600})
        context = trace.set_span_in_context(server)
        for name, start, end in CHILDREN:
            attributes = {semconv.REQUEST_ID: rid}
            if name == semconv.SPAN_STORAGE_READ:
                attributes[semconv.READER_TIDS] = [1000 + n, 2000 + n]
            child = tracer.start_span(name, context=context, start_time=arrival + start * MS,
                                      attributes=attributes)
            child.end(end_time=arrival + end * MS)
        server.end(end_time=arrival + 300 * MS)
    provider.shutdown()


@pytest.fixture
def otlp_dir(tmp_path) -> Path:
    directory = tmp_path / "otlp"
    _write_sdk_spans(directory)
    return directory


def _otlp_request(otlp_dir: Path) -> otlp_json.Request:
    request = otlp_json.Request()
    for path in sorted(otlp_dir.glob("*.json")):
        request.MergeFrom(otlp_json.loads(path.read_bytes()))
    return request


def _import_and_analyze(source: list[str], out: Path, capsys) -> None:
    assert main(["import", *source, "--out", str(out)]) == 0, capsys.readouterr().err
    attribution = analysis.attribute(analysis.load_run(out)).set_index("request_id")
    assert sorted(attribution.index) == [f"req-{n}" for n in range(REQUESTS)]
    assert set(attribution["window"]) == {"server"}
    assert (attribution["ttft_ns"] == round(TTFT_S * 1e9)).all()
    assert (attribution["queueing_ns"] == 28 * MS).all()
    assert (attribution["storage_read_ns"] == 60 * MS).all()
    assert (attribution["prefill_ns"] == 60 * MS).all()
    parts = [f"{c}_ns" for c in analysis.attribution.COMPONENTS]
    assert (attribution[parts].sum(axis=1) == attribution["ttft_ns"]).all()
    spans = analysis.load_run(out).spans
    reads = spans[spans["name"] == semconv.SPAN_STORAGE_READ].set_index("request_id")
    assert {rid: a[semconv.READER_TIDS] for rid, a in reads["attributes"].items()} == {
        f"req-{n}": [1000 + n, 2000 + n] for n in range(REQUESTS)}, "arrays come back typed"


def test_otlp_json_files_written_by_the_sdk(otlp_dir, tmp_path, capsys):
    _import_and_analyze([str(otlp_dir)], tmp_path / "run", capsys)


def test_otlp_json_lines_in_the_collector_file_exporter_layout(otlp_dir, tmp_path, capsys):
    lines = tmp_path / "traces.jsonl"
    lines.write_text("".join(p.read_text() + "\n" for p in sorted(otlp_dir.glob("*.json"))))
    _import_and_analyze([str(lines)], tmp_path / "run", capsys)


def test_jaeger_json_download(otlp_dir, tmp_path, capsys):
    path = tmp_path / "jaeger.json"
    path.write_text(json.dumps(jaeger_forms.ui_json(_otlp_request(otlp_dir))))
    _import_and_analyze([str(path)], tmp_path / "run", capsys)


def test_jaeger_uis_top_level_array_of_traces(otlp_dir, tmp_path, capsys):
    path = tmp_path / "jaeger.json"
    path.write_text(json.dumps(jaeger_forms.ui_json(_otlp_request(otlp_dir))["data"]))
    _import_and_analyze([str(path)], tmp_path / "run", capsys)


@pytest.fixture
def standin_jaeger():
    """A stand-in for Jaeger's query service (none can run here): answers every GET with the
    status and body it is given, and keeps the paths asked."""
    answer: dict = {"status": 200, "body": ""}
    asked: list[str] = []

    class Jaeger(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's method name)
            asked.append(self.path)
            self.send_response(answer["status"])
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(answer["body"].encode())

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Jaeger)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", answer, asked
    server.shutdown()


def test_jaeger_v3_answer_over_jaegers_model_with_stringified_arrays(otlp_dir, tmp_path, capsys,
                                                                     standin_jaeger):
    url, answer, asked = standin_jaeger
    answer["body"] = json.dumps(jaeger_forms.api_v3_json(_otlp_request(otlp_dir)))
    assert '"stringValue": "[1000,2000]"' in answer["body"], "Jaeger's form of an array"
    _import_and_analyze(["--url", url, "--since", "60"], tmp_path / "run", capsys)
    assert asked[0].startswith("/api/v3/traces?query.service_name=kvscope-vllm&")


def test_jaeger_v3_answers_streamed_one_object_per_batch(otlp_dir, tmp_path, capsys,
                                                         standin_jaeger):
    url, answer, _ = standin_jaeger
    answer["body"] = "".join(json.dumps({"result": json.loads(p.read_text())})
                             for p in sorted(otlp_dir.glob("*.json")))
    _import_and_analyze(["--url", url, "--since", "60"], tmp_path / "run", capsys)


def test_import_url_shows_the_backends_error_text(tmp_path, capsys, standin_jaeger):
    url, answer, _ = standin_jaeger
    answer["status"] = 404  # what Jaeger's /api/v3 answers when nothing matched
    answer["body"] = json.dumps({"error": {"httpCode": 404, "message": "No traces found"}})
    assert main(["import", "--url", url, "--since", "60", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "HTTP 404" in err and "No traces found" in err and "--since" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("content", "says"), [
    pytest.param('{"resourceSpans": [{"scopeSpans": [', "not valid JSON at line 1",
                 id="truncated"),
    pytest.param('{"spans_of": "something else"}', "not a trace document", id="wrong-format"),
    pytest.param(json.dumps({"traceID": "1", "spans": [
        {"traceID": "1", "spanID": "2", "operationName": "GET /", "references": [],
         "startTime": 1485467191639875, "duration": 5, "tags": [], "processID": "p1"}],
        "processes": {"p1": {"serviceName": "service-x", "tags": []}}}),
        "no kvscope.server.request span (services found: service-x)", id="other-services"),
    pytest.param("", "empty", id="empty"),
])
def test_bad_files_are_named_with_what_was_expected(tmp_path, capsys, content, says):
    path = tmp_path / "traces.json"
    path.write_text(content)
    assert main(["import", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and says in err, err
    assert not (tmp_path / "run").exists(), "nothing written for bad input"


TRACE, SPAN = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"


def _otlp(**span: object) -> str:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": TRACE, "spanId": SPAN, "name": semconv.SPAN_SERVER_REQUEST,
        "startTimeUnixNano": str(T0), "endTimeUnixNano": str(T0 + MS), **span}]}]}]})


def _jaeger(trace: dict | None = None, **span: object) -> str:
    return json.dumps({"data": [{"traceID": TRACE, "spans": [{
        "traceID": TRACE, "spanID": SPAN, "operationName": semconv.SPAN_SERVER_REQUEST,
        "references": [], "startTime": T0 // 1000, "duration": 5, "tags": [],
        "processID": "p1", **span}],
        "processes": {"p1": {"serviceName": "kvscope-vllm", "tags": []}}, **(trace or {})}]})


@pytest.mark.parametrize(("content", "field"), [
    pytest.param('{"resourceSpans": {"scopeSpans": []}}',
                 "resourceSpans: a JSON object where an array belongs", id="resourceSpans-dict"),
    pytest.param('{"resourceSpans": [{"scopeSpans": [{"spans": [1, 2]}]}]}',
                 "resourceSpans[0].scopeSpans[0].spans[0]: a JSON number where an object",
                 id="ints-as-spans"),
    pytest.param(_otlp(spanId=12), "spans[0].spanId: 12 is not an id", id="otlp-int-span-id"),
    pytest.param(_otlp(traceId=TRACE[:24]), "spans[0].traceId: '5b8efff798038103d269b633' is "
                 "not an id of 16 bytes", id="otlp-short-trace-id"),
    pytest.param(_otlp(links=[{"traceId": TRACE + "00", "spanId": SPAN}]),
                 "spans[0].links[0].traceId: ", id="otlp-long-link-id"),
    pytest.param(_otlp(attributes=[{"key": semconv.READER_TIDS,
                                    "value": {"stringValue": "[18253"}}]),
                 "attribute kvscope.storage.reader_tids: '[18253' is not an array of integers",
                 id="broken-array"),
    pytest.param(_jaeger({"processes": [{"serviceName": "x"}]}),
                 "data[0].processes: a JSON array where an object belongs",
                 id="jaeger-processes-list"),
    pytest.param(_jaeger(tags=["kvscope.phase=cold"]),
                 "data[0].spans[0].tags[0]: a JSON string where an object belongs",
                 id="jaeger-tags-strings"),
    pytest.param(_jaeger(spanID=12), "data[0].spans[0].spanID: 12 is not an id",
                 id="jaeger-int-span-id"),
    pytest.param(_jaeger(spanID=SPAN * 2), "data[0].spans[0].spanID: ", id="jaeger-long-id"),
    pytest.param(_jaeger(processID="p9"), "data[0].spans[0].processID: 'p9' is not one of",
                 id="jaeger-unknown-process"),
    pytest.param(_jaeger(tags=[{"key": semconv.READ_BYTES, "type": "int64", "value": "many"}]),
                 "data[0].spans[0].tags[0] (kvscope.storage.read_bytes): 'many' is not",
                 id="jaeger-bad-int"),
    pytest.param("[" * 100_000, "nested too deeply", id="deeply-nested"),
    pytest.param(_otlp(startTimeUnixNano="<long>").replace('"<long>"', "9" * 5000),
                 "spans[0].startTimeUnixNano: Couldn't parse integer: a number of over 4300 "
                 "digits", id="otlp-integer-of-5000-digits"),
    pytest.param(_jaeger(startTime="<long>").replace('"<long>"', "9" * 5000),
                 "data[0].spans[0].startTime: a number of over 4300 digits is not a whole",
                 id="jaeger-integer-of-5000-digits"),
    pytest.param(_otlp(kind="<inf>").replace('"<inf>"', "Infinity"),
                 "spans[0]: an infinite number (or one of too many digits) where an enum",
                 id="otlp-kind-infinity"),
    pytest.param(_otlp(startTimeUnixNano=str(2**63)),
                 f"spans[0].startTimeUnixNano: {2**63} is later than kvscope's times reach",
                 id="otlp-time-past-int64-ns"),
    pytest.param(_otlp(endTimeUnixNano=2**64 - 1),
                 f"spans[0].endTimeUnixNano: {2**64 - 1} is later than kvscope's times reach",
                 id="otlp-end-time-a-number-past-int64-ns"),
    pytest.param(_otlp(startTimeUnixNano=str(2**64)),
                 f"spans[0].startTimeUnixNano: Value out of range: {2**64}",
                 id="otlp-time-past-fixed64"),
    pytest.param(_otlp(startTimeUnixNano=-1), "spans[0].startTimeUnixNano: Value out of range: -1",
                 id="otlp-negative-time"),
    pytest.param(_otlp(attributes=[{"key": semconv.READ_BYTES,
                                    "value": {"stringValue": str(2**63)}}]),
                 f"attribute kvscope.storage.read_bytes: '{2**63}' is not an integer (int64)",
                 id="otlp-kvscope-integer-past-int64"),
    pytest.param(_jaeger(startTime=-1),
                 "data[0].spans[0].startTime: -1 is not a time in microseconds from 0 to",
                 id="jaeger-negative-start"),
    pytest.param(_jaeger(startTime=MAX_TIME_US + 1),
                 f"data[0].spans[0].startTime: {MAX_TIME_US + 1} is not a time in microseconds",
                 id="jaeger-start-past-int64-ns"),
    pytest.param(_jaeger(startTime=1e300),
                 "data[0].spans[0].startTime: 1e+300 is not a time in microseconds",
                 id="jaeger-float-start"),
    pytest.param(_jaeger(startTime=float("nan")), "data[0].spans[0].startTime: nan is not a whole",
                 id="jaeger-nan-start"),
    pytest.param(_jaeger(duration=-5), "data[0].spans[0].duration: -5 is not a time",
                 id="jaeger-negative-duration"),
    pytest.param(_jaeger(startTime=MAX_TIME_US - 1),
                 "data[0].spans[0].duration: 5 after startTime 9223372036854774 ends later than",
                 id="jaeger-end-past-int64-ns"),
    pytest.param(_jaeger(logs=[{"timestamp": MAX_TIME_US + 1, "fields": []}]),
                 "data[0].spans[0].logs[0].timestamp: ", id="jaeger-log-time-past-int64-ns"),
    pytest.param(_jaeger(tags=[{"key": "x", "type": "int64", "value": 2**63}]),
                 f"data[0].spans[0].tags[0] (x): {2**63} is beyond int64",
                 id="jaeger-int64-tag-past-int64"),
    pytest.param(_jaeger(tags=[{"key": "x", "type": "int64", "value": "9" * 5000}]),
                 "data[0].spans[0].tags[0] (x): '99999", id="jaeger-int64-tag-of-5000-digits"),
    pytest.param(_jaeger(tags=[{"key": semconv.READ_BYTES, "type": "float64",
                                "value": float("inf")}]),
                 "data[0].spans[0] ('kvscope.server.request'): attribute "
                 "kvscope.storage.read_bytes: inf is not an integer", id="jaeger-kvscope-int-inf"),
    pytest.param(_jaeger(processID={"p1": 1}),
                 "data[0].spans[0].processID: {'p1': 1} is not one of the trace's processes",
                 id="jaeger-process-id-an-object"),
    pytest.param(_jaeger({"processes": {"p\n1\x1b[2J": []}}),
                 "data[0].processes.p\\n1\\x1b[2J: a JSON array where an object belongs",
                 id="jaeger-newline-and-escape-in-a-key"),
])
def test_hostile_files_are_one_line_naming_the_file_and_field(tmp_path, capsys, content, field):
    path = tmp_path / "traces.json"
    path.write_text(content)
    assert main(["import", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvscope import: {path}: ") and field in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists(), "nothing written for bad input"


def test_spans_ending_before_they_start_are_left_out_and_counted(otlp_dir, tmp_path, capsys):
    backwards = json.loads(_otlp(spanId="00000000000000aa", name=semconv.SPAN_QUEUE,
                                 endTimeUnixNano=str(T0 - 1)))
    (otlp_dir / "backwards.json").write_text(json.dumps(backwards))
    assert main(["import", str(otlp_dir), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "1 spans that end before they start were left out" in out, out
    spans = analysis.load_run(tmp_path / "run").spans
    assert (spans["end_ns"] >= spans["start_ns"]).all() and "00000000000000aa" not in set(
        spans["span_id"])


def test_link_ids_are_converted_like_span_ids(otlp_dir, tmp_path, capsys):
    linked = json.loads(_otlp(name=semconv.SPAN_QUEUE, links=[{"traceId": TRACE.upper(),
                                                              "spanId": SPAN}]))
    (otlp_dir / "linked.json").write_text(json.dumps(linked))
    assert main(["import", str(otlp_dir), "--out", str(tmp_path / "run")]) == 0, \
        capsys.readouterr().err
    written = [s for p in sorted((tmp_path / "run" / "spans").glob("*.json"))
               for rs in json.loads(p.read_text())["resourceSpans"]
               for ss in rs["scopeSpans"] for s in ss["spans"] if s.get("links")]
    assert [s["links"] for s in written] == [[{"traceId": TRACE, "spanId": SPAN}]]


def test_a_tracers_spans_directory_imports_as_it_is(tmp_path, capsys):
    """KVSCOPE_SPANS_DIR holds the span files and, beside them, the tracer's stats/ counters
    and parts/ tables."""
    spans_dir = tmp_path / "spans"
    _write_sdk_spans(spans_dir)
    assert list((spans_dir / "parts").glob("*.parquet")), "the exporter writes parts"
    (spans_dir / "stats").mkdir(mode=0o700)
    (spans_dir / "stats" / "vllm-4242.json").write_text('{"spans_ended": 20, "exporters": []}')
    _import_and_analyze([str(spans_dir)], tmp_path / "run", capsys)


def test_float_tags_of_infinity_and_nan_are_imported_as_the_doubles_they_are(tmp_path, capsys):
    path = tmp_path / "traces.json"
    path.write_text(_jaeger(tags=[{"key": "x.inf", "type": "float64", "value": float("inf")},
                                  {"key": "x.nan", "type": "float64", "value": float("nan")}]))
    assert main(["import", str(path), "--out", str(tmp_path / "run")]) == 0, \
        capsys.readouterr().err
    written = "".join(p.read_text() for p in (tmp_path / "run" / "spans").glob("*.json"))
    assert '"doubleValue":"Infinity"' in written and '"doubleValue":"NaN"' in written


def _sparse_past_the_cap(path: Path) -> None:
    path.touch()
    os.truncate(path, documents.MAX_DOCUMENT_BYTES + 1)


@pytest.mark.timeout(30)  # the guard against the hang this test is about: no timing is asserted
@pytest.mark.parametrize(("plant", "says"), [
    pytest.param(os.mkfifo, "is not a regular file", id="fifo"),
    pytest.param(lambda path: path.symlink_to("/dev/zero"), "is a symbolic link",
                 id="link-to-dev-zero"),
    pytest.param(_sparse_past_the_cap, f"over the {documents.MAX_DOCUMENT_BYTES}-byte cap",
                 id="over-the-cap"),
])
def test_a_trace_file_that_is_no_regular_file_or_over_the_cap_is_refused_in_one_line(
        tmp_path, capsys, plant, says):
    path = tmp_path / "traces.json"
    plant(path)
    assert main(["import", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvscope import: {path} ") and says in err, err
    assert f"of at most {documents.MAX_DOCUMENT_BYTES >> 20} MiB" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_fifo_in_a_directory_of_traces_is_not_waited_on(otlp_dir, tmp_path, capsys):
    os.mkfifo(otlp_dir / "pipe.json")
    _import_and_analyze([str(otlp_dir)], tmp_path / "run", capsys)


def test_trace_files_of_another_user_are_imported(otlp_dir, tmp_path, capsys):
    """Import reads what the user names, whoever wrote it: only its kind and size matter."""
    for path in otlp_dir.iterdir():
        os.chown(path, 65534, 65534)
    _import_and_analyze([str(otlp_dir)], tmp_path / "run", capsys)


@pytest.fixture
def oversized_jaeger():
    """A trace backend answering every GET with the status it is given and a body past the
    cap, streamed until the client hangs up (at most a MiB past the cap, so that code without
    the cap fails its test rather than the machine)."""
    answer = {"status": 200}

    class Oversized(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's method name)
            self.send_response(answer["status"])
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            chunk = b" " * (1 << 20)
            try:
                self.wfile.write(b"[")
                for _ in range((documents.MAX_DOCUMENT_BYTES >> 20) + 1):
                    self.wfile.write(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading: what a cap does

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Oversized)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", answer
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("status", "says"), [
    pytest.param(200, f"answered more than {documents.MAX_DOCUMENT_BYTES} bytes; not read; ask "
                 "for less: a shorter --since", id="traces"),
    pytest.param(500, "HTTP 500 (Internal Server Error): '[", id="error-answer"),
])
def test_an_answer_past_the_cap_is_refused_in_one_line(tmp_path, capsys, oversized_jaeger,
                                                       status, says):
    url, answer = oversized_jaeger
    answer["status"] = status
    assert main(["import", "--url", url, "--since", "60", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvscope import: {url}/api/v3/traces?") and says in err, err[:500]
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_foreign_trace_beside_the_servers_imports_and_analyses(otlp_dir, tmp_path, capsys):
    """Issue 30: a Collector's file holding another service's trace too (no span of it carries
    kvscope.request_id) imported, but analyze stopped on an ArrowTypeError filling request ids
    from that trace. Its spans are now left out and counted; the server's requests analyse."""
    provider = TracerProvider(resource=Resource.create({"service.name": "shop"}))
    provider.add_span_processor(SimpleSpanProcessor(OtlpJsonFileExporter(otlp_dir, "shop")))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("GET /cart", start_time=T0):
        tracer.start_span("SELECT carts", start_time=T0 + MS).end(end_time=T0 + 5 * MS)
    provider.shutdown()
    _import_and_analyze([str(otlp_dir)], tmp_path / "run", capsys)
    assert main(["analyze", str(tmp_path / "run"), "--no-plots"]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert any("2 spans carry no kvscope.request_id" in p for p in summary["problems"])
