"""The export pipeline: OTLP JSON files, OTLP/gRPC to a real receiver, loss counted not blocking."""

from __future__ import annotations

import json
import time

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from tracer_testkit import free_tcp_port, wait_until

from analysis import otlp
from tracer import pipeline, semconv
from tracer.fileexport import OtlpJsonFileExporter
from tracer.runtime import Runtime


def _runtime(env: dict[str, str]) -> Runtime:
    return Runtime(pipeline.build("test-service", "test", env), offset_ns=1_000_000_000)


def _emit(rt: Runtime, count: int, start_ns: int = 5_000) -> list:
    spans = []
    for i in range(count):
        span = rt.tracer.start_span(semconv.SPAN_QUEUE, start_time=rt.epoch(start_ns + i),
                                    attributes={semconv.REQUEST_ID: f"r{i}"})
        span.end(end_time=rt.epoch(start_ns + i + 10))
        spans.append(span)
    return spans


def test_file_exporter_writes_one_otlp_json_document_per_batch_with_hex_ids(tmp_path):
    rt = _runtime({pipeline.ENV_SPANS_DIR: str(tmp_path)})
    spans = _emit(rt, 3)
    rt.pipeline.flush_files()
    _emit(rt, 2, start_ns=9_000)
    rt.pipeline.shutdown()

    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 2
    document = json.loads(files[0].read_text())
    first = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert first["traceId"] == format(spans[0].get_span_context().trace_id, "032x")
    assert first["spanId"] == format(spans[0].get_span_context().span_id, "016x")
    frame, problems = otlp.read_span_files(files, offset_ns=1_000_000_000)
    assert problems == []
    assert sorted(frame["start_ns"]) == [5_000, 5_001, 5_002, 9_000, 9_001]
    assert sorted(frame["request_id"]) == ["r0", "r0", "r1", "r1", "r2"]
    assert not list(tmp_path.glob(".*.tmp")), "temporary files are renamed, never left"
    stats = json.loads((tmp_path / pipeline.STATS_DIR / next(
        (tmp_path / pipeline.STATS_DIR).iterdir()).name).read_text())
    assert stats["spans_ended"] == 5 and stats["spans_exported"] == {"file": 5}


def test_spans_reach_a_real_otlp_grpc_receiver_decoded(otlp_receiver):
    receiver, endpoint = otlp_receiver
    rt = _runtime({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint})
    spans = _emit(rt, 4)
    rt.pipeline.shutdown()

    got = receiver.spans()
    assert sorted(s.span_id.hex() for s in got) == sorted(
        format(s.get_span_context().span_id, "016x") for s in spans)
    assert {s.name for s in got} == {semconv.SPAN_QUEUE}
    assert sorted(s.start_time_unix_nano for s in got) == [
        1_000_005_000, 1_000_005_001, 1_000_005_002, 1_000_005_003]
    resource = receiver.requests[0].resource_spans[0].resource
    assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == (
        "test-service")
    assert rt.pipeline.counters.spans_exported == {"otlp": 4}


def test_endpoint_down_costs_the_caller_nothing_and_every_lost_span_is_counted(tmp_path):
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{free_tcp_port()}",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "1", pipeline.ENV_SPANS_DIR: str(tmp_path)}
    rt = _runtime(env)
    _emit(rt, 10)
    rt.pipeline.flush_files()
    counters = rt.pipeline.counters
    assert wait_until(lambda: counters.failed_spans == 10, timeout_s=30)
    assert counters.export_failures >= 1
    assert counters.spans_exported == {"file": 10}, "the file copy is unaffected"


def test_slow_endpoint_drops_what_does_not_fit_and_counts_it(slow_otlp_receiver):
    receiver, endpoint = slow_otlp_receiver
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint, "OTEL_BSP_MAX_QUEUE_SIZE": "8",
           "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4", "OTEL_BSP_SCHEDULE_DELAY": "10"}
    rt = _runtime(env)
    started = time.monotonic()
    _emit(rt, 200)
    assert time.monotonic() - started < 1.5, "ending spans never waits for the collector"
    counters = rt.pipeline.counters
    assert counters.spans_dropped > 0
    rt.pipeline.shutdown()  # waits for what is queued; on a loaded machine exports may time out
    assert counters.spans_exported.get("otlp", 0) + counters.spans_dropped \
        + counters.failed_spans == 200
    # An export that timed out on our side may still have reached the receiver.
    assert 0 < counters.spans_exported["otlp"] <= len(receiver.spans())


class _Raising(SpanExporter):
    def export(self, spans):
        raise ConnectionError("collector went away")

    def shutdown(self):
        pass


def test_a_raising_exporter_is_counted_and_logged_once(caplog):
    counters = pipeline.Counters()
    exporter = pipeline.CountingExporter("otlp", _Raising(), counters)
    with caplog.at_level("WARNING", logger="tracer.pipeline"):
        results = [exporter.export([object()] * 3) for _ in range(4)]
    assert results == [SpanExportResult.FAILURE] * 4
    assert counters.export_failures == 4 and counters.failed_spans == 12
    assert len([r for r in caplog.records if "collector went away" in r.getMessage()]) == 1


@pytest.mark.parametrize(("env", "expected"), [
    pytest.param({}, None, id="no-endpoint-no-otlp"),
    pytest.param({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317"}, "grpc", id="base-endpoint"),
    pytest.param({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:4318/v1/traces",
                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, "http", id="http"),
    pytest.param({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317", "OTEL_TRACES_EXPORTER": "none"},
                 None, id="exporter-none"),
])
def test_otlp_exporter_follows_the_standard_environment(env, expected):
    exporter = pipeline.otlp_exporter(env)
    kind = None if exporter is None else type(exporter).__module__.split(".")[-2]
    assert kind == expected


def test_unsupported_protocol_is_a_clear_error():
    with pytest.raises(ValueError, match="http/json.*grpc.*http/protobuf"):
        pipeline.otlp_exporter({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318",
                                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_file_exporter_creates_its_directory(tmp_path):
    exporter = OtlpJsonFileExporter(tmp_path / "new" / "spans", "x")
    rt = _runtime({})
    span = rt.tracer.start_span("s")
    span.end()
    assert exporter.export([span]) is SpanExportResult.SUCCESS
    assert len(list((tmp_path / "new" / "spans").glob("x-*.json"))) == 1
