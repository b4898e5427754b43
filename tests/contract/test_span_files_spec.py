"""Every OTLP/JSON document kvscope writes follows the specification to the letter.

The writers: the tracer's span files (OtlpJsonFileExporter), the OTLP receiver of `kvscope
record --otlp-listen`, `kvscope export otlp` and the span files `kvscope import` writes. Each
document is parsed strictly into opentelemetry-proto's ExportTraceServiceRequest (protobuf's
json_format.Parse, unknown fields refused) after its hex ids are turned into base64 as the
OTLP/JSON specification says they differ from protobuf's mapping; then the rules the protobuf
parser does not check (it also takes enum names, snake_case keys, base64 ids and 64-bit
integers as numbers) are checked on the text itself.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvscope.capture.record.otlp_receiver import SpanFileReceiver
from kvscope.cli import main
from kvscope.contract import otlp_json, rundir, semconv
from kvscope.tracer.fileexport import OtlpJsonFileExporter

CAMEL = re.compile(r"[a-z][a-zA-Z0-9]*")
ID_HEX = {"traceId": 32, "spanId": 16, "parentSpanId": 16}
INT64_FIELDS = {"startTimeUnixNano", "endTimeUnixNano", "timeUnixNano", "intValue"}
ENUM_FIELDS = {"kind", "code"}
T0 = 1_764_000_000_000_000_000


def spec_problems(text: str) -> list[str]:
    """How the OTLP/JSON document `text` breaks the specification (empty when it does not)."""
    document = json.loads(text)
    problems = [f"{path}: {why}" for path, why in _rule_breaks(document, "")]
    try:
        json_format.Parse(json.dumps(_base64_ids(document)), otlp_json.Request())
    except json_format.ParseError as e:
        problems.append(f"strict protobuf parse: {e}")
    return problems


def _rule_breaks(value: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, list):
        for n, item in enumerate(value):
            yield from _rule_breaks(item, f"{path}[{n}]")
        return
    if not isinstance(value, dict):
        return
    for key, item in value.items():
        where = f"{path}.{key}"
        if not CAMEL.fullmatch(key):
            yield where, "keys are lowerCamelCase field names"
        if key in ID_HEX and not (isinstance(item, str) and len(item) == ID_HEX[key]
                                  and re.fullmatch(r"[0-9a-f]*", item)):
            yield where, f"ids are {ID_HEX[key]} lowercase hex characters, got {item!r}"
        if key in ENUM_FIELDS and not isinstance(item, int):
            yield where, f"enums are integers, got {item!r}"
        if key in INT64_FIELDS and not (isinstance(item, str) and re.fullmatch(r"-?\d+", item)):
            yield where, f"64-bit integers are decimal strings, got {item!r}"
        yield from _rule_breaks(item, where)


def _base64_ids(value: Any) -> Any:
    """Hex ids as protobuf's mapping writes bytes (ids that are not hex are left as they are:
    the rules above report them)."""
    if isinstance(value, list):
        return [_base64_ids(v) for v in value]
    if isinstance(value, dict):
        return {k: _base64(v) if k in ID_HEX else _base64_ids(v) for k, v in value.items()}
    return value


def _base64(text: Any) -> Any:
    try:
        return base64.b64encode(bytes.fromhex(text)).decode()
    except (TypeError, ValueError):
        return text


def test_the_checker_catches_what_the_protobuf_parser_lets_through():
    written = {"resourceSpans": [{"scope_spans": [{"spans": [{
        "traceId": "5B8EFFF798038103D269B633813FC60C", "spanId": "7u8b0yTfIWs=",
        "kind": "SPAN_KIND_SERVER", "startTimeUnixNano": 5}]}]}]}
    problems = spec_problems(json.dumps(written))
    assert [p.split(":")[0] for p in problems] == [
        ".resourceSpans[0].scope_spans", ".resourceSpans[0].scope_spans[0].spans[0].traceId",
        ".resourceSpans[0].scope_spans[0].spans[0].spanId",
        ".resourceSpans[0].scope_spans[0].spans[0].kind",
        ".resourceSpans[0].scope_spans[0].spans[0].startTimeUnixNano"], problems


def _sdk_spans(directory: Path) -> None:
    """Spans of every shape the tracer makes: kinds, a link, an event, an error status,
    arrays, bools, doubles, through the tracer's own file exporter."""
    provider = TracerProvider(resource=Resource.create({semconv.SERVICE_NAME: "kvscope-vllm",
                                                        semconv.PROCESS_PID: 4242}))
    provider.add_span_processor(SimpleSpanProcessor(OtlpJsonFileExporter(directory, "vllm")))
    tracer = provider.get_tracer("kvscope.tracer", "0.1.0")
    server = tracer.start_span(semconv.SPAN_SERVER_REQUEST, kind=trace.SpanKind.SERVER,
                               start_time=T0, attributes={semconv.REQUEST_ID: "r0",
                                                          semconv.GEN_AI_TTFT: 0.25})
    server.add_event(semconv.EVENT_FIRST_TOKEN, timestamp=T0 + 250)
    context = trace.set_span_in_context(server)
    read = tracer.start_span(semconv.SPAN_STORAGE_READ, context=context, start_time=T0 + 10,
                             links=[trace.Link(server.get_span_context())], attributes={
                                 semconv.REQUEST_ID: "r0", semconv.READER_TIDS: [7, 8],
                                 semconv.READ_AHEAD: True, semconv.READ_BYTES: 1 << 40})
    read.set_status(trace.Status(trace.StatusCode.ERROR, "short read"))
    read.end(end_time=T0 + 90)
    ledger = tracer.start_span(semconv.SPAN_KV_LEDGER, context=context, start_time=T0 + 5,
                               attributes={semconv.LEDGER_TIER: ["disk", "none"],
                                           semconv.LEDGER_FACT_NS: [-1, 12]})
    ledger.end(end_time=T0 + 5)
    server.end(end_time=T0 + 300)
    provider.shutdown()


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, list[Path]]:
    """The documents of each writer, made from the same spans."""
    base = tmp_path_factory.mktemp("writers")
    tracer_files = base / "tracer"
    _sdk_spans(tracer_files)
    sdk_files = sorted(tracer_files.glob("*.json"))
    messages = [otlp_json.loads(p.read_bytes()) for p in sdk_files]
    receiver_dir = base / "receiver"
    receiver_dir.mkdir()
    receiver = SpanFileReceiver(receiver_dir)
    for message in messages:
        bytes_value = message.resource_spans[0].resource.attributes.add()
        bytes_value.key, bytes_value.value.bytes_value = "host.id", b"\x00\xff"
        receiver.Export(message, None)
    assert main(["import", str(tracer_files), "--out", str(base / "imported")]) == 0
    assert main(["export", "otlp", str(base / "imported"), "-o", str(base / "merged.json")]) == 0
    return {"tracer span files": sdk_files,
            "record --otlp-listen": sorted(receiver_dir.glob("*.json")),
            "import span files": sorted((base / "imported" / rundir.SPANS_DIR).glob("*.json")),
            "export otlp": [base / "merged.json"]}


@pytest.mark.parametrize("writer", ["tracer span files", "record --otlp-listen",
                                    "import span files", "export otlp"])
def test_every_writer_writes_spec_exact_otlp_json(written, writer):
    documents = written[writer]
    assert documents
    for path in documents:
        assert spec_problems(path.read_text()) == [], path
    spans = [s for p in documents for s in otlp_json.spans(otlp_json.loads(p.read_bytes()))]
    assert len(spans) == 3
    read = next(s for s in spans if s.name == semconv.SPAN_STORAGE_READ)
    server = next(s for s in spans if s.name == semconv.SPAN_SERVER_REQUEST)
    assert (read.links[0].trace_id, read.links[0].span_id) == (server.trace_id, server.span_id)
    assert otlp_json.attributes(read.attributes)[semconv.READER_TIDS] == [7, 8]
    assert server.events[0].name == semconv.EVENT_FIRST_TOKEN
