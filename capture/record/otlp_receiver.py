"""An OTLP/gRPC trace receiver that writes what it receives into a run's span directory.

For a server whose spans go to a collector rather than to files: point the server's
OTEL_EXPORTER_OTLP_ENDPOINT at `kvscope record --otlp-listen`, and every export request becomes
one OTLP JSON file (the run directory's span format), written to a temporary name and renamed.
"""

from __future__ import annotations

import itertools
import threading
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvscope.contract import files, otlp_json


class SpanFileReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Writes each ExportTraceServiceRequest as `otlp-<n>.json` into `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.spans = 0
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        with self._lock:
            name = f"otlp-{next(self._numbers):06d}.json"
            self.spans += sum(len(ss.spans) for rs in request.resource_spans
                              for ss in rs.scope_spans)
        files.atomic_write(self.directory / name, otlp_json.dumps(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpListener:
    """The receiver served on `address` (host:port) until stop()."""

    def __init__(self, address: str, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.receiver = SpanFileReceiver(directory)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self.receiver, self._server)
        port = self._server.add_insecure_port(address)
        if port == 0:
            raise ValueError(f"--otlp-listen {address}: cannot listen there (in use, or not a "
                             "host:port); pick a free port")
        self.port = port
        self._server.start()

    def stop(self, grace_s: float = 2.0) -> None:
        self._server.stop(grace=grace_s).wait()
