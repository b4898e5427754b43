"""An OTLP/gRPC trace receiver that writes what it receives into a run's span directory.

For a server whose spans go to a collector rather than to files: point the server's
OTEL_EXPORTER_OTLP_ENDPOINT at `kvscope record --otlp-listen`, and every export request becomes
one OTLP JSON file (the run directory's span format), written to a temporary name and renamed.

Anyone who can reach the address can send to it (OTLP has no authentication), and `kvscope
record` often runs as root, so what it accepts is bounded: the port is bound before the run
directory exists (a busy port is one line, and a retry finds no half-made run), SO_REUSEPORT is
off (no other process shares the port unnoticed), one request is converted at a time, a request
over MAX_MESSAGE_BYTES, over MAX_ITEMS elements (spans, events, links, attributes and the items
of values at any depth) or with values nested over MAX_VALUE_DEPTH deep is refused before it is
converted, and past `Limits` (bytes written, files) every request is refused.
"""

from __future__ import annotations

import ipaddress
import itertools
import socket
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import Message
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

from kvscope.contract import files, otlp_json

# gRPC's own default, set explicitly: the tracer's batches (512 spans) are far smaller.
MAX_MESSAGE_BYTES = 4 << 20
# Elements of one request: spans, events, links, attributes and every other element of a
# repeated field, the items of array and key-value list values at any depth included. A batch
# of 512 spans of ~40 attributes is ~20k. 4 MiB of empty attributes is ~700k, which took 500 MB
# and 16 s to convert; one attribute of a 1M-item array (2 MB), 130-470 MB.
MAX_ITEMS = 100_000
# Arrays and key-value lists nested in one value: attributes are scalars or arrays of them, and
# a structured one (a gen_ai message with its parts and a tool call's arguments) a few levels.
MAX_VALUE_DEPTH = 16
MAX_QUEUED_REQUESTS = 16  # beyond: RESOURCE_EXHAUSTED, which OTLP exporters retry
_NESTING = frozenset({common_pb2.ArrayValue.DESCRIPTOR.full_name,
                      common_pb2.KeyValueList.DESCRIPTOR.full_name})


@dataclass(frozen=True)
class Limits:
    """What one recording's receiver writes at most; then it refuses every request."""

    max_bytes: int = 16 << 30
    max_files: int = 1_000_000


def over_caps(request: Message) -> str | None:
    """Why `request` is too large to convert, or None: more than MAX_ITEMS elements of repeated
    fields anywhere in it, or a value nested more than MAX_VALUE_DEPTH arrays or key-value
    lists deep. Found by walking the parsed message, not converting it, every field alike (so
    scope and link attributes and nested values count as span attributes do), and a repeated
    field's length is counted before any of its elements is visited: the walk visits at most
    MAX_ITEMS messages, and a 1M-item array is refused on its length alone."""
    count = 0
    stack: list[tuple[Message, int]] = [(request, 0)]
    while stack:
        message, depth = stack.pop()
        for field, value in message.ListFields():
            if field.message_type is None:
                continue
            nested = depth + (field.message_type.full_name in _NESTING)
            if nested > MAX_VALUE_DEPTH:
                return (f"a value nested more than {MAX_VALUE_DEPTH} arrays or key-value lists "
                        "deep")
            if not field.is_repeated:
                stack.append((value, nested))
                continue
            count += len(value)
            if count > MAX_ITEMS:
                return (f"a request of more than {MAX_ITEMS} spans, events, links, attributes "
                        "and items of values")
            stack.extend((item, nested) for item in value)
    return None


class SpanFileReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Writes each ExportTraceServiceRequest as `otlp-<n>.json` into `directory`."""

    def __init__(self, directory: Path, limits: Limits = Limits()) -> None:
        self.directory = directory
        self.limits = limits
        self.spans = 0
        self.bytes_written = 0
        self.files_written = 0
        self.refused: dict[str, int] = {}  # why -> requests refused
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        why = self._refusal(request)
        if why is not None:
            with self._lock:
                self.refused[why] = self.refused.get(why, 0) + 1
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"kvscope record: {why}")
        body = otlp_json.dumps(request).encode()
        with self._lock:
            if self.bytes_written + len(body) > self.limits.max_bytes:
                self.refused["byte limit reached"] = self.refused.get("byte limit reached", 0) + 1
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"kvscope record: {self.limits.max_bytes} bytes received")
            name = f"otlp-{next(self._numbers):06d}.json"
            self.bytes_written += len(body)
            self.files_written += 1
            self.spans += sum(len(ss.spans) for rs in request.resource_spans
                              for ss in rs.scope_spans)
        files.atomic_write(self.directory / name, body)
        return trace_service_pb2.ExportTraceServiceResponse()

    def _refusal(self, request: trace_service_pb2.ExportTraceServiceRequest) -> str | None:
        with self._lock:
            if self.files_written >= self.limits.max_files:
                return f"file limit reached ({self.limits.max_files} requests received)"
        return over_caps(request)


class OtlpListener:
    """The receiver, bound to `address` (host:port) at construction, serving from `start`
    until `stop`."""

    def __init__(self, address: str, limits: Limits = Limits()) -> None:
        host, port = _check_free(address)
        self.limits = limits
        self.receiver: SpanFileReceiver | None = None
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=1),
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=MAX_QUEUED_REQUESTS)
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise ValueError(f"--otlp-listen {address}: cannot listen there; pick a free port "
                             "on an address of this host")
        self.loopback = _loopback(host)

    def start(self, directory: Path) -> SpanFileReceiver:
        """Serve, writing into `directory` (made private if missing)."""
        files.private_dir(directory)
        self.receiver = SpanFileReceiver(directory, self.limits)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self.receiver, self._server)
        self._server.start()
        return self.receiver

    def stop(self, grace_s: float = 2.0) -> None:
        self._server.stop(grace=grace_s).wait()

    def __enter__(self) -> "OtlpListener":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop(grace_s=0)


def _check_free(address: str) -> tuple[str, int]:
    """(host, port) of `address`; ValueError in one line when it is no host:port or the port
    is in use (checked with a plain socket: gRPC's own failure is two lines of its log)."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    except (ValueError, OSError) as e:
        raise ValueError(f"--otlp-listen {address}: not a HOST:PORT this host can listen on "
                         f"({e}); e.g. 127.0.0.1:4317") from None
    if port == 0:
        return host, port
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            probe.bind(sockaddr)
        except OSError as e:
            raise ValueError(f"--otlp-listen {address}: {e.strerror}; stop what listens there "
                             "or pick another port") from None
    return host, port


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
