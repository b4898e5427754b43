"""Jaeger's JSON trace format (the UI's download, `/api/traces`) as OTLP messages.

A Jaeger trace is `{"traceID", "spans": [...], "processes": {id: {"serviceName", "tags"}}}`;
a span has hex ids (not zero-padded), `startTime` and `duration` in microseconds, `tags` of
typed key/values and `references` (the CHILD_OF one is the parent). Each process becomes an
OTLP resource (service.name from serviceName, its tags as attributes), so the emitting process
survives the round trip just as it does over OTLP.
"""

from __future__ import annotations

import base64
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2

NS_PER_US = 1000


def is_jaeger(document: Any) -> bool:
    """A single Jaeger trace, or a `{"data": [traces]}` answer of Jaeger's query API."""
    if isinstance(document, dict) and isinstance(document.get("data"), list):
        return all(_is_trace(t) for t in document["data"])
    return _is_trace(document)


def _is_trace(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("spans"), list) and \
        isinstance(item.get("processes"), dict)


def to_otlp(document: dict[str, Any]) -> trace_service_pb2.ExportTraceServiceRequest:
    """The spans of a Jaeger document as one ExportTraceServiceRequest."""
    traces = document["data"] if "data" in document else [document]
    request = trace_service_pb2.ExportTraceServiceRequest()
    for trace in traces:
        by_process: dict[str, Any] = {}
        for process_id, process in trace["processes"].items():
            resource_spans = request.resource_spans.add()
            _set(resource_spans.resource.attributes.add(), "service.name",
                 process.get("serviceName", ""))
            for tag in process.get("tags") or ():
                _set_tag(resource_spans.resource.attributes.add(), tag)
            by_process[process_id] = resource_spans.scope_spans.add()
        for span in trace["spans"]:
            _add_span(by_process[span["processID"]].spans.add(), span)
    return request


def _add_span(out: Any, span: dict[str, Any]) -> None:
    out.trace_id = _id(span["traceID"], 16)
    out.span_id = _id(span["spanID"], 8)
    parents = [r for r in span.get("references") or ()
               if r.get("refType") == "CHILD_OF" and r.get("traceID") == span["traceID"]]
    if parents:
        out.parent_span_id = _id(parents[0]["spanID"], 8)
    out.name = span["operationName"]
    out.start_time_unix_nano = int(span["startTime"]) * NS_PER_US
    out.end_time_unix_nano = (int(span["startTime"]) + int(span["duration"])) * NS_PER_US
    for tag in span.get("tags") or ():
        _set_tag(out.attributes.add(), tag)


def _id(text: str, size: int) -> bytes:
    return bytes.fromhex(text.rjust(size * 2, "0"))


def _set_tag(attribute: common_pb2.KeyValue, tag: dict[str, Any]) -> None:
    kind, value = tag.get("type", "string"), tag.get("value")
    if kind == "binary":
        value = base64.b64decode(value)
    elif kind == "int64":
        value = int(value)
    elif kind == "float64":
        value = float(value)
    _set(attribute, tag["key"], value)


def _set(attribute: common_pb2.KeyValue, key: str, value: Any) -> None:
    attribute.key = key
    if isinstance(value, bool):
        attribute.value.bool_value = value
    elif isinstance(value, int):
        attribute.value.int_value = value
    elif isinstance(value, float):
        attribute.value.double_value = value
    elif isinstance(value, bytes):
        attribute.value.bytes_value = value
    else:
        attribute.value.string_value = str(value)
