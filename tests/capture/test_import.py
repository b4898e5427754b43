"""`kvscope import`: trace files in the formats backends write, and Jaeger's OTLP query API,
become run directories that `kvscope analyze` splits exactly; bad input is named."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvscope import analysis
from kvscope.cli import main
from kvscope.contract import semconv
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
            child = tracer.start_span(name, context=context, start_time=arrival + start * MS,
                                      attributes={semconv.REQUEST_ID: rid})
            child.end(end_time=arrival + end * MS)
        server.end(end_time=arrival + 300 * MS)
    provider.shutdown()


@pytest.fixture
def otlp_dir(tmp_path) -> Path:
    directory = tmp_path / "otlp"
    _write_sdk_spans(directory)
    return directory


def _jaeger_document(otlp_dir: Path) -> dict:
    """The same spans in Jaeger's JSON format (the UI's download / /api/traces answer)."""
    traces: dict[str, dict] = {}
    for path in sorted(otlp_dir.glob("*.json")):
        for resource_spans in json.loads(path.read_text())["resourceSpans"]:
            tags = [{"key": a["key"], "type": "int64" if "intValue" in a["value"] else "string",
                     "value": int(a["value"]["intValue"]) if "intValue" in a["value"]
                     else a["value"].get("stringValue", "")}
                    for a in resource_spans["resource"]["attributes"]]
            service = next(t["value"] for t in tags if t["key"] == "service.name")
            for scope in resource_spans["scopeSpans"]:
                for span in scope["spans"]:
                    trace_ = traces.setdefault(span["traceId"], {
                        "traceID": span["traceId"], "spans": [],
                        "processes": {"p1": {"serviceName": service, "tags": tags}},
                        "warnings": None})
                    start_us = int(span["startTimeUnixNano"]) // 1000
                    trace_["spans"].append({
                        "traceID": span["traceId"], "spanID": span["spanId"].lstrip("0"),
                        "operationName": span["name"],
                        "references": [{"refType": "CHILD_OF", "traceID": span["traceId"],
                                        "spanID": span["parentSpanId"]}]
                        if span.get("parentSpanId") else [],
                        "startTime": start_us,
                        "duration": int(span["endTimeUnixNano"]) // 1000 - start_us,
                        "tags": [_jaeger_tag(a) for a in span.get("attributes", ())],
                        "logs": [], "processID": "p1", "warnings": None})
    return {"data": list(traces.values()), "total": 0, "limit": 0, "offset": 0, "errors": None}


def _jaeger_tag(attribute: dict) -> dict:
    value = attribute["value"]
    if "doubleValue" in value:
        return {"key": attribute["key"], "type": "float64", "value": value["doubleValue"]}
    if "intValue" in value:
        return {"key": attribute["key"], "type": "int64", "value": int(value["intValue"])}
    return {"key": attribute["key"], "type": "string", "value": value["stringValue"]}


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


def test_otlp_json_files_written_by_the_sdk(otlp_dir, tmp_path, capsys):
    _import_and_analyze([str(otlp_dir)], tmp_path / "run", capsys)


def test_otlp_json_lines_in_the_collector_file_exporter_layout(otlp_dir, tmp_path, capsys):
    lines = tmp_path / "traces.jsonl"
    lines.write_text("".join(p.read_text() + "\n" for p in sorted(otlp_dir.glob("*.json"))))
    _import_and_analyze([str(lines)], tmp_path / "run", capsys)


def test_jaeger_json_download(otlp_dir, tmp_path, capsys):
    path = tmp_path / "jaeger.json"
    path.write_text(json.dumps(_jaeger_document(otlp_dir)))
    _import_and_analyze([str(path)], tmp_path / "run", capsys)


def test_jaeger_v3_query_api_standin_jaeger(otlp_dir, tmp_path, capsys):
    """A stand-in for Jaeger's query service (none can run here) answering /api/v3/traces."""
    answers = "".join(json.dumps({"result": json.loads(p.read_text())})
                      for p in sorted(otlp_dir.glob("*.json")))
    asked = []

    class Jaeger(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's method name)
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(answers.encode())

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Jaeger)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _import_and_analyze(["--url", f"http://127.0.0.1:{server.server_port}",
                             "--since", "60"], tmp_path / "run", capsys)
    finally:
        server.shutdown()
    assert asked[0].startswith("/api/v3/traces?query.service_name=kvscope-vllm&")


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
