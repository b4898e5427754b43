"""OTLP JSON span documents -> one DataFrame of spans on the run's monotonic clock.

Parsing goes through opentelemetry-proto's ExportTraceServiceRequest with protobuf's JSON
support, so attribute value types follow OTLP exactly. OTLP JSON writes trace and span ids as
hex, where protobuf's JSON mapping expects base64; see `_hex_id` for how both are accepted.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pandas as pd
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2

from kvscope.contract import semconv
from kvscope.contract.semconv import NO_PID, SPAN_COLUMNS
_HEX = frozenset("0123456789abcdefABCDEF")


def empty_spans() -> pd.DataFrame:
    """The spans frame with its columns and dtypes and no rows."""
    return _frame([])


def read_span_files(files: list[Path], offset_ns: int) -> tuple[pd.DataFrame, list[str]]:
    """All spans of `files` (epoch ns minus `offset_ns` = monotonic ns) and the files' problems."""
    rows: list[tuple[Any, ...]] = []
    problems: list[str] = []
    for path in files:
        message = trace_service_pb2.ExportTraceServiceRequest()
        try:
            json_format.Parse(path.read_text(), message, ignore_unknown_fields=True)
        except (json_format.ParseError, UnicodeDecodeError) as e:
            problems.append(f"{path}: not an OTLP JSON ExportTraceServiceRequest ({e}); skipped")
            continue
        rows += _rows(message, offset_ns)
    return _frame(rows), problems


def _rows(message: trace_service_pb2.ExportTraceServiceRequest, offset_ns: int) -> list[tuple]:
    rows = []
    for resource_spans in message.resource_spans:
        resource = {a.key: any_value(a.value) for a in resource_spans.resource.attributes}
        process = (str(resource.get("service.name", "")), _pid(resource.get("process.pid")))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attributes = {a.key: any_value(a.value) for a in span.attributes}
                request_id = attributes.get(semconv.REQUEST_ID)
                rows.append((
                    _hex_id(span.trace_id, 32), _hex_id(span.span_id, 16),
                    _hex_id(span.parent_span_id, 16), span.name,
                    span.start_time_unix_nano - offset_ns, span.end_time_unix_nano - offset_ns,
                    None if request_id is None else str(request_id), attributes, *process,
                ))
    return rows


def _frame(rows: list[tuple]) -> pd.DataFrame:
    frame = pd.DataFrame.from_records(rows, columns=list(SPAN_COLUMNS))
    return frame.astype({"start_ns": "int64", "end_ns": "int64", "service": "str",
                         "pid": "int64"})


def _pid(value: Any) -> int:
    """The resource's process.pid as an int (the emitting process), NO_PID when absent."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return NO_PID


def _hex_id(raw: bytes, hex_len: int) -> str:
    """The id as lower-case hex, whether the document wrote it as OTLP hex or proto base64.

    A hex id of 32 (16) characters is also valid base64, which protobuf decodes to 24 (12)
    bytes; encoding those bytes back gives the hex text unchanged. A true 16 (8) byte id that
    was written as base64 decodes to its real length instead, so the two cannot be confused.
    """
    if not raw:
        return ""
    if len(raw) * 4 == hex_len * 3:
        text = base64.b64encode(raw).decode()
        if set(text) <= _HEX:
            return text.lower()
    return raw.hex()


def any_value(value: common_pb2.AnyValue) -> Any:
    """An OTLP AnyValue as the plain Python value it carries."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)
