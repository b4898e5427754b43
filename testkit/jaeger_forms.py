"""kvscope's spans in the forms Jaeger stores and serves them, for the import round trip.

No Jaeger runs here, so these are written from Jaeger's own conversion rules (the OpenTelemetry
Collector contrib translator pkg/translator/jaeger, traces_to_jaegerproto.go and
jaegerproto_to_traces.go, which Jaeger's v1 storage and `/api/v3` use, and Jaeger's
internal/uimodel/converter/v1/json/from_domain.go for the UI's JSON), independently of
kvscope's importer:

- `ui_json`: `/api/traces` and the UI's download. The resource becomes a process (service.name
  its serviceName, the rest its tags); kind, status, scope and trace state become tags; events
  become logs with an `event` field; the parent is the first CHILD_OF reference, links are
  FOLLOWS_FROM references (their attributes are lost); times are whole microseconds (start
  truncated, duration truncated); an array or key-value list is a string tag holding its JSON
  text (Go's encoding/json: compact, `<>&` escaped), bytes a binary tag (base64), an integer
  beyond 2^53 its digits as a string.
- `api_v3_json`: `/api/v3/traces` over a storage that keeps Jaeger's model (Elasticsearch,
  Cassandra): the same model turned back into OTLP JSON (hex ids, integer enums) inside
  `{"result": ...}`, so arrays stay strings, bytes become base64 strings, times stay whole
  microseconds, and each link gains `opentracing.ref_type`.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from kvscope.contract import otlp_json, semconv

JS_SAFE_INTEGER = (1 << 53) - 1
_KIND_TAG = {trace_pb2.Span.SPAN_KIND_INTERNAL: "internal",
             trace_pb2.Span.SPAN_KIND_SERVER: "server",
             trace_pb2.Span.SPAN_KIND_CLIENT: "client",
             trace_pb2.Span.SPAN_KIND_PRODUCER: "producer",
             trace_pb2.Span.SPAN_KIND_CONSUMER: "consumer"}
_STATUS_TAG = {trace_pb2.Status.STATUS_CODE_OK: "OK",
               trace_pb2.Status.STATUS_CODE_ERROR: "ERROR"}
_GO_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
               "\u2029": "\\u2029"}


def go_json(value: Any) -> str:
    """`value` as Go's json.Marshal writes it (what pcommon.Value.AsString gives an array)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escape in _GO_ESCAPES.items():
        text = text.replace(char, escape)
    return text


def micros(ns: int) -> int:
    """Go's integer division by 1000: toward zero."""
    return ns // 1000 if ns >= 0 else -(-ns // 1000)


# --- /api/traces, the UI's JSON ----------------------------------------------------------------

def ui_json(request: otlp_json.Request) -> dict[str, Any]:
    """The spans of `request` as Jaeger's `/api/traces` answers them (one trace per trace id)."""
    traces: dict[bytes, dict[str, Any]] = {}
    for resource_spans in request.resource_spans:
        process = _process(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                trace = traces.setdefault(span.trace_id, {"spans": [], "processes": []})
                if process not in trace["processes"]:
                    trace["processes"].append(process)
                number = trace["processes"].index(process) + 1
                trace["spans"].append(_ui_span(span, scope_spans.scope, f"p{number}"))
    data = [{"traceID": _trace_id(trace_id), "spans": trace["spans"],
             "processes": {f"p{n}": p for n, p in enumerate(trace["processes"], start=1)},
             "warnings": None}
            for trace_id, trace in traces.items()]
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}


def _process(attributes: Any) -> dict[str, Any]:
    service = next((a.value.string_value for a in attributes
                    if a.key == semconv.SERVICE_NAME), "OTLPResourceNoServiceName")
    return {"serviceName": service,
            "tags": [_tag(a.key, a.value) for a in attributes if a.key != semconv.SERVICE_NAME]}


def _ui_span(span: trace_pb2.Span, scope: common_pb2.InstrumentationScope,
             process_id: str) -> dict[str, Any]:
    references = []
    if span.parent_span_id:
        references.append({"refType": "CHILD_OF", "traceID": _trace_id(span.trace_id),
                           "spanID": otlp_json.hex_id(span.parent_span_id)})
    for link in span.links:
        references.append({"refType": "FOLLOWS_FROM", "traceID": _trace_id(link.trace_id),
                           "spanID": otlp_json.hex_id(link.span_id)})
    tags = [_string_tag(k, v) for k, v in (("otel.scope.name", scope.name),
                                          ("otel.scope.version", scope.version)) if v]
    tags += [_tag(a.key, a.value) for a in span.attributes]
    if span.kind in _KIND_TAG:
        tags.append(_string_tag("span.kind", _KIND_TAG[span.kind]))
    if span.status.code in _STATUS_TAG:
        tags.append(_string_tag("otel.status_code", _STATUS_TAG[span.status.code]))
    if span.status.code == trace_pb2.Status.STATUS_CODE_ERROR:
        tags.append({"key": "error", "type": "bool", "value": True})
    if span.status.message:
        tags.append(_string_tag("otel.status_description", span.status.message))
    if span.trace_state:
        tags.append(_string_tag("w3c.tracestate", span.trace_state))
    return {
        "traceID": _trace_id(span.trace_id), "spanID": otlp_json.hex_id(span.span_id),
        "operationName": span.name, "references": references,
        "startTime": micros(span.start_time_unix_nano),
        "duration": micros(span.end_time_unix_nano - span.start_time_unix_nano),
        "tags": tags, "logs": [_log(event) for event in span.events],
        "processID": process_id, "warnings": None,
    }


def _log(event: trace_pb2.Span.Event) -> dict[str, Any]:
    fields = []
    if event.name and not any(a.key == "event" for a in event.attributes):
        fields.append(_string_tag("event", event.name))
    fields += [_tag(a.key, a.value) for a in event.attributes]
    return {"timestamp": micros(event.time_unix_nano), "fields": fields}


def _tag(key: str, value: common_pb2.AnyValue) -> dict[str, Any]:
    kind = value.WhichOneof("value")
    if kind == "bool_value":
        return {"key": key, "type": "bool", "value": value.bool_value}
    if kind == "int_value":
        number = value.int_value
        return {"key": key, "type": "int64",
                "value": number if abs(number) <= JS_SAFE_INTEGER else str(number)}
    if kind == "double_value":
        return {"key": key, "type": "float64", "value": value.double_value}
    if kind == "bytes_value":
        return {"key": key, "type": "binary",
                "value": base64.b64encode(value.bytes_value).decode()}
    if kind in ("array_value", "kvlist_value"):
        return _string_tag(key, go_json(otlp_json.any_value(value)))
    return _string_tag(key, value.string_value)


def _string_tag(key: str, text: str) -> dict[str, Any]:
    return {"key": key, "type": "string", "value": text}


def _trace_id(raw: bytes) -> str:
    """Jaeger's TraceID.String(): 16 hex characters when the high 64 bits are zero."""
    return otlp_json.hex_id(raw[8:] if not any(raw[:8]) else raw)


# --- /api/v3/traces over Jaeger's model ---------------------------------------------------------

def api_v3_json(request: otlp_json.Request) -> dict[str, Any]:
    """The spans of `request` as `/api/v3/traces` gives them back from Jaeger's model."""
    stored = otlp_json.Request()
    stored.CopyFrom(request)
    for resource_spans in stored.resource_spans:
        _as_stored(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                _as_stored(span.attributes)
                start, end = span.start_time_unix_nano, span.end_time_unix_nano
                span.start_time_unix_nano = micros(start) * 1000
                span.end_time_unix_nano = span.start_time_unix_nano + micros(end - start) * 1000
                for event in span.events:
                    _as_stored(event.attributes)
                    event.time_unix_nano = micros(event.time_unix_nano) * 1000
                for link in span.links:
                    del link.attributes[:]
                    ref = link.attributes.add()
                    ref.key, ref.value.string_value = "opentracing.ref_type", "follows_from"
    return {"result": otlp_json.encode(stored)}


def _as_stored(attributes: Any) -> None:
    """Attribute values as Jaeger's model keeps them and gives them back."""
    for attribute in attributes:
        value = attribute.value
        kind = value.WhichOneof("value")
        if kind in ("array_value", "kvlist_value"):
            value.string_value = go_json(otlp_json.any_value(value))
        elif kind == "bytes_value":
            value.string_value = base64.b64encode(value.bytes_value).decode()
