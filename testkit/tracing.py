"""Helpers the tracer tests share: a real OTLP/gRPC receiver, free ports, polling."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every request it gets (optionally slowly)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list:
        with self._lock:
            return [span for request in self.requests for rs in request.resource_spans
                    for ss in rs.scope_spans for span in ss.spans]


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_receiver(delay_s: float = 0.0) -> tuple[Receiver, grpc.Server, int]:
    receiver = Receiver(delay_s)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return receiver, server, port


def wait_until(predicate, timeout_s: float = 20.0, step_s: float = 0.05) -> bool:
    """Poll `predicate` (exports are asynchronous by design); True once it holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def assert_children_nest_in_parents(spans, remote_parents: frozenset[str] = frozenset()
                                    ) -> None:
    """Every span with a parent lies within it (a spans frame of analysis.otlp); the parents
    in `remote_parents` are callers' spans, not in the frame."""
    by_id = spans.set_index(["trace_id", "span_id"])
    children = spans[(spans["parent_span_id"] != "")
                     & ~spans["parent_span_id"].isin(remote_parents)]
    assert len(children) > 0
    for child in children.itertuples():
        parent = by_id.loc[(child.trace_id, child.parent_span_id)]
        assert parent["start_ns"] <= child.start_ns <= child.end_ns <= parent["end_ns"], (
            child.name, parent["name"])


def read_until(proc, prefix: str) -> list[str]:
    """Lines of `proc`'s stderr up to and including the first that starts with `prefix`."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(prefix):
            return seen
    raise AssertionError(f"never printed {prefix!r}: {''.join(seen)}")


class RecordedSpans:
    """A serving runtime whose rings this process reads itself: the spans the tracer records,
    rebuilt as the exporter process rebuilds them (times monotonic: clock offset 0)."""

    def __init__(self) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import sampling

        from kvscope.tracer.recorder import Recorder
        from kvscope.tracer.runtime import Runtime

        self.rings: list = []
        self.runtime = Runtime(Recorder(self.rings.append), 0, sampling.ALWAYS_ON, None)
        self.resource = Resource.create({})
        self.spans: list = []

    def get_finished_spans(self) -> list:
        from kvscope.tracer.exporter import readable_span

        for ring in self.rings:
            records, _ = ring.read(1 << 20)
            ring.commit(len(records))
            self.spans += [readable_span(r, self.resource, 0) for r in records if r.is_span]
        return list(self.spans)


class SdkTracer:
    """A pipeline as the exporter process builds one (tracer/pipeline.py), fed spans through
    the OpenTelemetry SDK's own tracer: for tests of the pipeline and the files it writes."""

    def __init__(self, pipe, offset_ns: int) -> None:
        from kvscope.tracer.version import SCOPE

        self.pipeline, self.offset_ns = pipe, offset_ns
        self.tracer = pipe.provider.get_tracer(SCOPE)

    def epoch(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns
