"""The file exporter's parts: each span file's rows of the span table, written beside it from
the SDK spans, equal to what the reader makes of the file, or not written at all."""

from __future__ import annotations

import json
import os
import stat

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from kvscope.analysis import spanstream, spantable
from kvscope.contract import semconv
from kvscope.contract import spantable as spec
from kvscope.contract.env import ENV_SPANS_DIR
from kvscope.tracer import failsafe, pipeline
from kvscope.tracer.fileexport import PART_ERRORS, OtlpJsonFileExporter
from kvscope.testkit.tracing import SdkTracer

OFFSET = 1_000_000_000
REMOTE = trace.SpanContext(0x5B8EFFF798038103D269B633813FC60C, 0xEEE19B7EC3C1B174, True,
                           trace.TraceFlags(1))


def _export(directory, attributes: list[dict], resource: dict | None = None) -> None:
    """One batch, a span per attribute dict (every other one a child of a remote parent),
    through the SDK and OtlpJsonFileExporter."""
    provider = TracerProvider(resource=Resource.create(
        resource or {"service.name": "s", "process.pid": 7}))
    collected: list[ReadableSpan] = []
    provider.add_span_processor(SimpleSpanProcessor(_Keep(collected)))
    tracer = provider.get_tracer("kvscope.tracer")
    for n, attrs in enumerate(attributes):
        context = trace.set_span_in_context(trace.NonRecordingSpan(REMOTE)) if n % 2 else None
        tracer.start_span(f"s{n}", context=context, start_time=OFFSET + 10 + n,
                          attributes=attrs).end(end_time=OFFSET + 20 + n)
    provider.shutdown()
    assert OtlpJsonFileExporter(directory, "t").export(collected).name == "SUCCESS"


class _Keep(SpanExporter):
    def __init__(self, into: list[ReadableSpan]) -> None:
        self.into = into

    def export(self, spans):
        self.into.extend(spans)
        return SpanExportResult.SUCCESS


def _span_file(directory):
    (path,) = sorted(directory.glob("*.json"))
    return path


def _parsed(path):
    return spanstream._parsed(path, path.read_bytes(), OFFSET)


def test_each_span_file_gets_a_private_part_in_parts_named_after_it(tmp_path):
    rt = SdkTracer(pipeline.build("test-service", "test", {ENV_SPANS_DIR: str(tmp_path)}),
                   offset_ns=OFFSET)
    for batch in range(2):
        for i in range(3):
            span = rt.tracer.start_span(semconv.SPAN_QUEUE, start_time=rt.epoch(i),
                                        attributes={semconv.REQUEST_ID: f"r{batch}-{i}"})
            span.end(end_time=rt.epoch(i + 10))
        rt.pipeline.flush()
    rt.pipeline.shutdown()

    span_files = sorted(tmp_path.glob("*.json"))
    parts = sorted((tmp_path / spec.PARTS_DIR).iterdir())
    assert [p.name for p in parts] == [f"{p.stem}.parquet" for p in span_files]
    assert stat.S_IMODE((tmp_path / spec.PARTS_DIR).stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in parts)
    assert not list((tmp_path / spec.PARTS_DIR).glob(".*.tmp"))
    for path in span_files:
        rows = spanstream.part_rows(path, path.read_bytes(), OFFSET)
        assert rows is not None and rows.equals(_parsed(path)[0])
        assert sorted(rows["start_ns"].to_pylist()) == [0, 1, 2]


def test_a_parts_rows_are_the_readers_rows_of_its_file_for_every_kind_of_value(tmp_path):
    _export(tmp_path, [
        {semconv.REQUEST_ID: "r1", "b": True, "i": -(1 << 62), "f": 0.5, "s": "é<&>",
         "ints": [1, 2], "strs": ("a", ""), "floats": [1.5], "bools": [True], "empty": []},
        {semconv.REQUEST_ID: "r1", "nan": float("nan"), "inf": [float("inf")], "raw": b"\x00\x01"},
        # kvscope keys of another type than declared, which the reader converts
        {semconv.REQUEST_ID: "r2", semconv.GEN_AI_TTFT: 1, semconv.READ_BYTES: "4096",
         semconv.READER_TIDS: "[3, 4]", semconv.CONCURRENCY: 2.0},
        {semconv.PHASE: "warm", semconv.READ_CHUNK_SUBMIT_NS: (5, 6)},  # no request id
    ], resource={"service.name": "svc", "process.pid": "42"})
    path = _span_file(tmp_path)
    rows = spanstream.part_rows(path, path.read_bytes(), OFFSET)
    parsed, problems = _parsed(path)
    assert problems == [] and rows is not None
    assert rows.equals(parsed), rows.to_pylist()
    frame = spantable.frame(spantable.build([path], OFFSET))
    assert frame["pid"].tolist() == [42] * 4
    assert frame.set_index("name")["request_id"]["s3"] == "r1"  # filled from its trace
    assert json.dumps(frame["attributes"][1], default=str).count("NaN") == 1


@pytest.mark.parametrize("attributes", [
    {semconv.READ_BYTES: "lots"},  # the reader skips the document: not an integer
    {"big": 1 << 70},  # past OTLP's int64: protobuf refuses the document
    {"text": type("Text", (str,), {})("x")},  # json writes a str subclass's text
], ids=["kvscope-key-not-its-type", "int-past-int64", "str-subclass"])
def test_a_batch_the_reader_reads_otherwise_than_its_spans_gets_no_part(tmp_path, attributes):
    _export(tmp_path, [{semconv.REQUEST_ID: "r1", **attributes}])
    path = _span_file(tmp_path)
    assert not (tmp_path / spec.PARTS_DIR / f"{path.stem}.parquet").exists()
    table = spantable.build([path], OFFSET)  # what the reader makes of the file stands
    assert table.num_rows + len(json.loads(table.schema.metadata[spec.META_PROBLEMS])) == 1


@pytest.mark.parametrize("planted", ["file", "link"])
def test_a_part_that_cannot_be_written_is_counted_and_the_span_file_still_is(tmp_path,
                                                                             planted):
    victim = tmp_path / "victim"
    victim.mkdir()
    spans = tmp_path / "spans"
    spans.mkdir(mode=0o700)
    if planted == "file":
        (spans / spec.PARTS_DIR).write_text("not a directory")
    else:
        os.symlink(victim, spans / spec.PARTS_DIR)
    _export(spans, [{semconv.REQUEST_ID: "r1"}])
    path = _span_file(spans)
    assert spanstream.part_rows(path, path.read_bytes(), OFFSET) is None
    assert failsafe.counts() == {PART_ERRORS: 1}
    assert list(victim.iterdir()) == [], "nothing written through the link"
    assert spantable.build([path], OFFSET).num_rows == 1
