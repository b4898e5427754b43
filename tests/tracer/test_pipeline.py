"""The export pipeline: OTLP JSON files, OTLP/gRPC to a real receiver, loss counted exactly."""

from __future__ import annotations

import json
import os
import random
import stat
import threading
import time

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from kvscope.contract.env import ENV_SPANS_DIR
from kvscope.testkit.tracing import SdkTracer, free_tcp_port, wait_until

from kvscope.analysis import otlp
from kvscope.tracer import config, failsafe, pipeline
from kvscope.contract import otlp_json, semconv
from kvscope.tracer.fileexport import OtlpJsonFileExporter, span_file
from kvscope.tracer.ids import ProcessIdGenerator
from kvscope.tracer.run import summarize_stats


def _runtime(env: dict[str, str]) -> SdkTracer:
    return SdkTracer(pipeline.build("test-service", "test", env), offset_ns=1_000_000_000)


def _emit(rt: SdkTracer, count: int, start_ns: int = 5_000) -> list:
    spans = []
    for i in range(count):
        span = rt.tracer.start_span(semconv.SPAN_QUEUE, start_time=rt.epoch(start_ns + i),
                                    attributes={semconv.REQUEST_ID: f"r{i}"})
        span.end(end_time=rt.epoch(start_ns + i + 10))
        spans.append(span)
    return spans


def _adds_up(counts: dict, ended: int) -> bool:
    return ended == counts["exported"] + counts["failed"] + counts["dropped"] + counts["lost"] \
        + counts["pending"] and counts["accepted"] + counts["dropped"] == ended


def test_file_exporter_writes_one_otlp_json_document_per_batch_with_hex_ids(tmp_path):
    rt = _runtime({ENV_SPANS_DIR: str(tmp_path)})
    spans = _emit(rt, 3)
    rt.pipeline.flush()
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
    (stats_path,) = (tmp_path / pipeline.STATS_DIR).iterdir()
    stats = json.loads(stats_path.read_text())
    assert stats["spans_ended"] == 5 and stats["spans_exported"] == {"file": 5}
    assert stats["closed"] is True and stats["by_exporter"]["file"]["pending"] == 0


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
    assert rt.pipeline.counters.as_dict()["spans_exported"] == {"otlp": 4}


def test_otlp_schedule_delay_is_short_unless_set(otlp_receiver):
    """The server's last spans reach the collector within a fraction of a second."""
    receiver, endpoint = otlp_receiver
    rt = _runtime({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint})
    assert rt.pipeline.config.batch["schedule_delay_millis"] == pipeline.FILE_FLUSH_MS
    _emit(rt, 3)
    assert wait_until(lambda: len(receiver.spans()) == 3, timeout_s=3)
    rt.pipeline.shutdown()
    slow = config.load({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
                        "OTEL_BSP_SCHEDULE_DELAY": "5000"})
    assert slow.batch["schedule_delay_millis"] == 5000


def test_endpoint_down_costs_the_caller_nothing_and_every_lost_span_is_counted(tmp_path):
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{free_tcp_port()}",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "1", ENV_SPANS_DIR: str(tmp_path)}
    rt = _runtime(env)
    _emit(rt, 10)
    rt.pipeline.flush()
    counts = rt.pipeline.counters.of("otlp")
    assert wait_until(lambda: counts.failed == 10, timeout_s=30)
    assert counts.export_failures >= 1
    assert rt.pipeline.counters.as_dict()["spans_exported"] == {"file": 10, "otlp": 0}


class _Blocked(SpanExporter):
    """A collector that hangs until released: what a stuck network looks like to the SDK."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans):
        self.release.wait()
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.release.set()


def test_a_blocked_exporter_drops_exactly_what_does_not_fit_through_public_api():
    counters = pipeline.Counters()
    inner = _Blocked()
    processor = pipeline.BoundedProcessor(
        pipeline.CountingExporter("otlp", inner, counters),
        {"max_queue_size": 8, "max_export_batch_size": 4, "schedule_delay_millis": 10,
         "export_timeout_millis": 30000})
    rt = _runtime({})
    rt.pipeline.provider.add_span_processor(processor)
    started = time.monotonic()
    _emit(rt, 100)
    assert time.monotonic() - started < 1.5, "ending spans never waits for the collector"
    counts = counters.of("otlp")
    assert (counts.accepted, counts.dropped, counts.pending) == (8, 92, 8), \
        "pending counts the batch being exported too, so the SDK's own queue never drops"
    inner.release.set()
    assert wait_until(lambda: counts.exported == 8, timeout_s=10)
    _emit(rt, 3)
    processor.shutdown()
    assert (counts.accepted, counts.exported, counts.dropped, counts.lost) == (11, 11, 92, 0)
    assert inner.exported == 11


def test_spans_still_pending_at_shutdown_are_counted_lost_and_it_all_adds_up(tmp_path):
    rt = _runtime({ENV_SPANS_DIR: str(tmp_path)})
    inner = _Blocked()
    inner.shutdown = lambda: None  # stays stuck through shutdown: a dead collector
    processor = pipeline.BoundedProcessor(
        pipeline.CountingExporter("otlp", inner, rt.pipeline.counters),
        {"max_queue_size": 50, "max_export_batch_size": 10, "schedule_delay_millis": 10,
         "export_timeout_millis": 30000})
    rt.pipeline.provider.add_span_processor(processor)
    rt.pipeline.processors["otlp"] = processor
    _emit(rt, 60)
    started = time.monotonic()
    rt.pipeline.shutdown()
    assert time.monotonic() - started < pipeline.SHUTDOWN_WAIT_S + 2, "shutdown is bounded"
    summary = summarize_stats(tmp_path, final=True)
    inner.release.set()  # the stuck export ends after the process counted it: still lost
    counts = summary["by_exporter"]["otlp"]
    assert (counts["dropped"], counts["lost"], counts["exported"], counts["pending"]) == (
        10, 50, 0, 0)
    assert summary["by_exporter"]["file"]["exported"] == 60
    for name, exporter in summary["by_exporter"].items():
        assert _adds_up(exporter, summary["spans_ended"]), (name, exporter)
    assert summary["spans_lost"] == 50 and summary["spans_dropped"] == 10
    time.sleep(0.2)
    assert rt.pipeline.counters.of("otlp").pending == 0, "a late export does not recount"


def test_a_raising_exporter_is_counted_and_logged_once(caplog):
    counters = pipeline.Counters()
    exporter = pipeline.CountingExporter("otlp", _Raising(), counters)
    with caplog.at_level("WARNING", logger="kvscope.tracer.pipeline"):
        results = [exporter.export([object()] * 3) for _ in range(4)]
    assert results == [SpanExportResult.FAILURE] * 4
    counts = counters.of("otlp")
    assert counts.export_failures == 4 and counts.failed == 12
    assert len([r for r in caplog.records if "collector went away" in r.getMessage()]) == 1


class _Raising(SpanExporter):
    def export(self, spans):
        raise ConnectionError("collector went away")

    def shutdown(self):
        pass


@pytest.mark.parametrize(("env", "expected"), [
    pytest.param({}, None, id="no-endpoint-no-otlp"),
    pytest.param({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317"}, "grpc", id="base-endpoint"),
    pytest.param({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:4318/v1/traces",
                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, "http", id="http"),
    pytest.param({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317", "OTEL_TRACES_EXPORTER": "none"},
                 None, id="exporter-none"),
])
def test_otlp_exporter_follows_the_standard_environment(env, expected):
    settings = config.load(env).otlp
    exporter = None if settings is None else pipeline.otlp_exporter(settings)
    kind = None if exporter is None else type(exporter).__module__.split(".")[-2]
    assert kind == expected


def test_the_spans_directory_is_made_private_at_start_up_and_by_the_exporter(tmp_path):
    spans = tmp_path / "new" / "spans"
    rt = _runtime({ENV_SPANS_DIR: str(spans)})
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (spans.parent, spans, spans / "stats")}
    assert set(modes.values()) == {0o700}, modes
    span = rt.tracer.start_span("s")
    span.end()
    assert OtlpJsonFileExporter(spans, "x").export([span]) is SpanExportResult.SUCCESS
    assert len(list(spans.glob("x-*.json"))) == 1
    assert OtlpJsonFileExporter(tmp_path / "later", "x").export([span]) is SpanExportResult.SUCCESS
    assert stat.S_IMODE((tmp_path / "later").stat().st_mode) == 0o700  # made private too
    (tmp_path / "open").mkdir(mode=0o777)
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(ValueError, match="group/world-writable"):  # counted failed by the pipeline
        OtlpJsonFileExporter(tmp_path / "open", "x").export([span])


def test_ids_are_the_processs_own_whatever_seeds_the_global_random():
    """vLLM seeds `random` alike in every process it starts (and so do tests): with the SDK's
    default generator two such processes drew the same span ids, one trace then holding two
    spans of one id. Seeding the global stream alike twice must not repeat an id."""
    drawn = []
    for _ in range(2):
        random.seed(0)
        rt = _runtime({})
        span = rt.tracer.start_span("s")
        span.end()
        drawn.append((span.context.trace_id, span.context.span_id))
    assert drawn[0] != drawn[1]


def test_a_forked_child_draws_other_ids_than_its_parent():
    generator = ProcessIdGenerator()
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: send its first span id, then leave without pytest's teardown
        os.write(write_end, generator.generate_span_id().to_bytes(8, "big"))
        os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    child_id = int.from_bytes(os.read(read_end, 8), "big")
    os.close(read_end)
    assert child_id != generator.generate_span_id()


def test_stats_carry_the_processes_kvscope_errors(tmp_path):
    rt = _runtime({ENV_SPANS_DIR: str(tmp_path), "OTEL_BSP_MAX_QUEUE_SIZE": "lots"})
    failsafe.count("Scheduler.schedule", KeyError("x"))
    rt.pipeline.shutdown()
    summary = summarize_stats(tmp_path, final=True)
    assert summary["hook_errors"] == {"Scheduler.schedule": 1}
    assert summary["config_errors"] == {"OTEL_BSP_MAX_QUEUE_SIZE": 1}


def test_span_files_hold_what_the_sdks_otlp_encoder_puts_in_its_message():
    """fileexport builds the document without protobuf (for speed); read back it is the
    message the SDK's own OTLP encoder makes of the same spans, field for field."""
    collected: list = []

    class Keep(SpanExporter):
        def export(self, spans):
            collected.extend(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider(resource=Resource.create({"service.name": "s", "process.pid": 7}))
    provider.add_span_processor(SimpleSpanProcessor(Keep()))
    tracer = provider.get_tracer("kvscope.tracer", "0.1.0")
    remote = trace.SpanContext(0x5B8EFFF798038103D269B633813FC60C, 0xEEE19B7EC3C1B174, True,
                               trace.TraceFlags(1), trace.TraceState([("vendor", "x=1")]))
    for n, kind in enumerate(trace.SpanKind):
        span = tracer.start_span(
            f"s{n}", kind=kind, start_time=10 + n, context=trace.set_span_in_context(
                trace.NonRecordingSpan(remote)) if n % 2 else None,
            links=[trace.Link(remote, {"why": "batch", "n": n})] if n == 3 else (),
            attributes={"b": bool(n % 2), "i": -(1 << 62) + n, "f": 0.5 + n, "s": "é<&>",
                        "ints": [1, 2, n], "strs": ("a", ""), "floats": [1.5], "bools": [True],
                        "empty": []})
        span.add_event("e", {"at": n}, timestamp=11 + n)
        if n == 2:
            span.set_status(trace.Status(trace.StatusCode.ERROR, "broke"))
        span.end(end_time=20 + n)
    other = TracerProvider(resource=Resource({"service.name": "t"}, "https://schema/1"))
    other.add_span_processor(SimpleSpanProcessor(Keep()))
    other.get_tracer("other").start_span("lone", start_time=1).end(end_time=2)

    assert len(collected) == len(trace.SpanKind) + 1
    written = otlp_json.decode(json.loads(span_file(collected)))
    assert written == encode_spans(collected)
