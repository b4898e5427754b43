"""Trace documents in the formats backends write, read into OTLP messages.

Accepted: an OTLP JSON document (`{"resourceSpans": ...}`, as the OpenTelemetry SDK and
kvscope's own span files write it); OTLP JSON lines (one document a line, the OpenTelemetry
Collector's file exporter); Jaeger's JSON (a trace from the UI's download, or `{"data": [...]}`
from `/api/traces`); and the answers of Jaeger's OTLP query API (`{"result": {"resourceSpans"}}`,
possibly several objects in a row). Every problem names the file and what was expected.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Iterator

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvscope.capture.trace_import import jaeger

EXPECTED = ("OTLP JSON, OTLP JSON lines (the Collector's file exporter), Jaeger JSON (UI "
            "download or /api/traces) or a Jaeger /api/v3/traces answer")
_ID_LENGTHS = {"traceId": 32, "spanId": 16, "parentSpanId": 16}


class TraceImportError(ValueError):
    """A trace file or answer kvscope cannot import; the message names it and says why."""


def read(path: Path) -> list[trace_service_pb2.ExportTraceServiceRequest]:
    """Every trace document in `path` (a file, or a directory of them) as OTLP messages."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise TraceImportError(f"{path}: no files in it; expected {EXPECTED}")
    return [message for file in files for message in read_text(_text(file), str(file))]


def read_text(text: str, source: str) -> list[trace_service_pb2.ExportTraceServiceRequest]:
    """The trace documents in `text` (from `source`, named in errors)."""
    return [_message(document, source) for document in _documents(text, source)]


def _text(file: Path) -> str:
    try:
        return file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceImportError(f"{file}: cannot be read as text ({e}); expected {EXPECTED}") \
            from None


def _documents(text: str, source: str) -> Iterator[Any]:
    """JSON values one after another: one document, JSON lines, or concatenated objects."""
    decoder = json.JSONDecoder()
    position, found = 0, False
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position >= len(text):
            break
        try:
            document, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as e:
            line = text.count("\n", 0, e.pos) + 1
            raise TraceImportError(f"{source}: not valid JSON at line {line} ({e.msg}; "
                                   f"truncated?); expected {EXPECTED}") from None
        found = True
        yield document
    if not found:
        raise TraceImportError(f"{source}: empty; expected {EXPECTED}")


def _message(document: Any, source: str) -> trace_service_pb2.ExportTraceServiceRequest:
    if isinstance(document, dict) and isinstance(document.get("result"), dict):
        document = document["result"]  # Jaeger's /api/v3 wraps the OTLP document
    if isinstance(document, dict) and "resourceSpans" in document:
        message = trace_service_pb2.ExportTraceServiceRequest()
        try:
            json_format.ParseDict(_base64_ids(document), message, ignore_unknown_fields=True)
        except json_format.ParseError as e:
            raise TraceImportError(f"{source}: an OTLP JSON document that does not parse "
                                   f"({e})") from None
        return message
    if jaeger.is_jaeger(document):
        try:
            return jaeger.to_otlp(document)
        except (KeyError, TypeError, ValueError) as e:
            raise TraceImportError(f"{source}: a Jaeger JSON trace with a bad span or process "
                                   f"({type(e).__name__}: {e})") from None
    keys = sorted(document)[:6] if isinstance(document, dict) else type(document).__name__
    raise TraceImportError(f"{source}: JSON, but not a trace document (found {keys}); "
                           f"expected {EXPECTED}")


def _base64_ids(document: dict[str, Any]) -> dict[str, Any]:
    """OTLP JSON writes ids as hex; protobuf's JSON parser wants base64 for bytes fields."""
    for resource_spans in document.get("resourceSpans") or ():
        for scope_spans in resource_spans.get("scopeSpans") or ():
            for span in scope_spans.get("spans") or ():
                for key, length in _ID_LENGTHS.items():
                    value = span.get(key)
                    if isinstance(value, str) and len(value) == length and _is_hex(value):
                        span[key] = base64.b64encode(bytes.fromhex(value)).decode()
    return document


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True
