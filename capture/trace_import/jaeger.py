"""Jaeger's JSON trace format (the UI's download, `/api/traces`) as OTLP messages.

A Jaeger trace is `{"traceID", "spans": [...], "processes": {id: {"serviceName", "tags"}}}`;
a span has hex ids (a 64-bit trace id written in 16 characters), `startTime` and `duration`
in microseconds, `tags` of typed key/values, `logs` and `references`. Jaeger makes that form
from OTLP by rules of its own (OpenTelemetry Collector contrib, pkg/translator/jaeger:
traces_to_jaegerproto.go, and Jaeger's internal/uimodel/converter/v1/json), which this module
undoes:

- the resource's `service.name` is the process's `serviceName`, its other attributes the
  process's tags;
- the span kind, status, scope and trace state are the tags `span.kind`, `otel.status_code` /
  `error` / `otel.status_description`, `otel.scope.name` / `otel.scope.version` (formerly
  `otel.library.*`) and `w3c.tracestate`;
- an event is a log whose field `event` holds its name; the parent is the first CHILD_OF
  reference in the same trace, every other reference a link;
- an array or key-value list attribute is a string tag of its JSON text, bytes a binary tag
  (base64 in JSON), an integer beyond 2^53 a decimal string: kvscope's own keys are restored to
  their declared types (contract.otlp_json.decode_attribute), other keys stay as Jaeger has them.

Times come back to the microsecond: Jaeger keeps no finer. Every problem raises JaegerError
naming the field (`data[0].spans[3].spanID: ...`).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from typing import Any

from opentelemetry.proto.trace.v1 import trace_pb2

from kvscope.contract import otlp_json, semconv

NS_PER_US = 1000
MAX_TIME_US = otlp_json.MAX_TIME_NS // NS_PER_US  # the last microsecond kvscope's times hold
_KIND = {"client": trace_pb2.Span.SPAN_KIND_CLIENT, "server": trace_pb2.Span.SPAN_KIND_SERVER,
         "producer": trace_pb2.Span.SPAN_KIND_PRODUCER,
         "consumer": trace_pb2.Span.SPAN_KIND_CONSUMER,
         "internal": trace_pb2.Span.SPAN_KIND_INTERNAL}
_STATUS = {"OK": trace_pb2.Status.STATUS_CODE_OK, "ERROR": trace_pb2.Status.STATUS_CODE_ERROR}
_SCOPE_TAGS = {"otel.scope.name": "name", "otel.scope.version": "version",
               "otel.library.name": "name", "otel.library.version": "version"}
_TAG_KIND, _TAG_STATUS, _TAG_ERROR = "span.kind", "otel.status_code", "error"
_TAG_STATUS_MESSAGE, _TAG_TRACE_STATE, _LOG_EVENT = ("otel.status_description",
                                                     "w3c.tracestate", "event")
_DIGITS = re.compile(r"[+-]?[0-9]+")
_INT64_DIGITS = 19  # of 2^63


class JaegerError(ValueError):
    """A Jaeger document kvscope cannot read; the message names the field."""


def traces_in(document: Any) -> tuple[list[Any], str | None] | None:
    """The traces of a Jaeger document and the path they sit at: a `{"data": [...]}` answer of
    `/api/traces`, a top-level array of traces (which Jaeger's UI also opens) or one trace;
    None when `document` is none of these."""
    if isinstance(document, dict) and "data" in document:
        return _array(document["data"], "data"), "data"
    if isinstance(document, list) and all(isinstance(t, dict) and "spans" in t
                                          for t in document):
        return document, ""
    if isinstance(document, dict) and "spans" in document and (
            "processes" in document or "traceID" in document):
        return [document], None
    return None


def to_otlp(traces: list[Any], at: str | None) -> otlp_json.Request:
    """The spans of Jaeger `traces` (found at path `at`, None for a lone trace) as one
    ExportTraceServiceRequest."""
    request = otlp_json.Request()
    for number, trace in enumerate(traces):
        where = "" if at is None else f"{at}[{number}]"
        _add_trace(request, _object(trace, where or "the trace"), where)
    return request


def _add_trace(request: otlp_json.Request, trace: dict[str, Any], where: str) -> None:
    processes = _object(trace.get("processes"), _join(where, "processes"))
    resources: dict[str, tuple[Any, dict[Any, Any]]] = {}
    for process_id, process in processes.items():
        process_where = _join(where, f"processes.{process_id}")
        process = _object(process, process_where)
        resource_spans = request.resource_spans.add()
        attributes = resource_spans.resource.attributes
        service = _string(process.get("serviceName", ""), f"{process_where}.serviceName")
        _put(attributes, semconv.SERVICE_NAME, service, process_where)
        for n, tag in enumerate(_array(process.get("tags") or [], f"{process_where}.tags")):
            key, value = _tag(tag, f"{process_where}.tags[{n}]")
            _put(attributes, key, value, process_where)
        resources[process_id] = (resource_spans, {})
    for n, span in enumerate(_array(trace.get("spans"), _join(where, "spans"))):
        span_where = _join(where, f"spans[{n}]")
        span = _object(span, span_where)
        span_process = span.get("processID")
        if not isinstance(span_process, str) or span_process not in resources:
            raise JaegerError(f"{span_where}.processID: {span_process!r} is not one of the "
                              f"trace's processes ({', '.join(map(repr, resources)) or 'none'})")
        resource_spans, scopes = resources[span_process]
        _add_span(resource_spans, scopes, span, span_where)


def _add_span(resource_spans: Any, scopes: dict[tuple[str, str], Any], span: dict[str, Any],
              where: str) -> None:
    tags = [_tag(tag, f"{where}.tags[{n}]")
            for n, tag in enumerate(_array(span.get("tags") or [], f"{where}.tags"))]
    scope = {"name": "", "version": ""}
    for key, value in tags:
        if key in _SCOPE_TAGS:
            scope[_SCOPE_TAGS[key]] = str(value)
    scope_key = (scope["name"], scope["version"])
    if scope_key not in scopes:
        scope_spans = resource_spans.scope_spans.add()
        scope_spans.scope.name, scope_spans.scope.version = scope_key
        scopes[scope_key] = scope_spans
    out = scopes[scope_key].spans.add()
    trace_id = _id(span.get("traceID"), otlp_json.TRACE_ID_BYTES, f"{where}.traceID")
    out.trace_id = trace_id
    out.span_id = _id(span.get("spanID"), otlp_json.SPAN_ID_BYTES, f"{where}.spanID")
    out.name = _string(span.get("operationName", ""), f"{where}.operationName")
    start_us = _microseconds(span.get("startTime"), f"{where}.startTime")
    end_us = start_us + _microseconds(span.get("duration"), f"{where}.duration")
    if end_us > MAX_TIME_US:
        raise JaegerError(f"{where}.duration: {span['duration']} after startTime {start_us} "
                          f"ends later than kvscope's times reach ({MAX_TIME_US} us after "
                          "1970, in the year 2262)")
    out.start_time_unix_nano = start_us * NS_PER_US
    out.end_time_unix_nano = end_us * NS_PER_US
    _references(out, span, trace_id, where)
    _special_tags(out, tags, where)
    for n, log in enumerate(_array(span.get("logs") or [], f"{where}.logs")):
        _add_event(out.events.add(), _object(log, f"{where}.logs[{n}]"), f"{where}.logs[{n}]")


def _references(out: Any, span: dict[str, Any], trace_id: bytes, where: str) -> None:
    parent_found = False
    for n, reference in enumerate(_array(span.get("references") or [], f"{where}.references")):
        ref_where = f"{where}.references[{n}]"
        reference = _object(reference, ref_where)
        ref_trace = _id(reference.get("traceID"), otlp_json.TRACE_ID_BYTES,
                        f"{ref_where}.traceID")
        ref_span = _id(reference.get("spanID"), otlp_json.SPAN_ID_BYTES, f"{ref_where}.spanID")
        kind = reference.get("refType", "CHILD_OF")
        if kind not in ("CHILD_OF", "FOLLOWS_FROM"):
            raise JaegerError(f"{ref_where}.refType: {kind!r} is neither CHILD_OF nor "
                              "FOLLOWS_FROM")
        if kind == "CHILD_OF" and ref_trace == trace_id and not parent_found:
            out.parent_span_id, parent_found = ref_span, True
        else:
            link = out.links.add()
            link.trace_id, link.span_id = ref_trace, ref_span


def _special_tags(out: Any, tags: list[tuple[str, Any]], where: str) -> None:
    """Tags Jaeger made from the span's own fields go back there; the rest are attributes."""
    values = dict(tags)
    if _TAG_KIND in values:
        out.kind = _KIND.get(str(values[_TAG_KIND]), trace_pb2.Span.SPAN_KIND_UNSPECIFIED)
    code = str(values.get(_TAG_STATUS, "")).upper()
    if values.get(_TAG_ERROR) is True or code in _STATUS:
        out.status.code = _STATUS["ERROR"] if values.get(_TAG_ERROR) is True else _STATUS[code]
        out.status.message = str(values.get(_TAG_STATUS_MESSAGE, ""))
    out.trace_state = str(values.get(_TAG_TRACE_STATE, ""))
    special = {_TAG_KIND, _TAG_STATUS, _TAG_STATUS_MESSAGE, _TAG_TRACE_STATE, *_SCOPE_TAGS}
    for key, value in tags:
        if key in special or (key == _TAG_ERROR and value is True):
            continue
        _put(out.attributes, key, value, f"{where} ({out.name!r})")


def _add_event(event: Any, log: dict[str, Any], where: str) -> None:
    event.time_unix_nano = _microseconds(log.get("timestamp"), f"{where}.timestamp") * NS_PER_US
    for n, field in enumerate(_array(log.get("fields") or [], f"{where}.fields")):
        key, value = _tag(field, f"{where}.fields[{n}]")
        if key == _LOG_EVENT and not event.name:
            event.name = str(value)
        else:
            _put(event.attributes, key, value, where)


def _tag(tag: Any, where: str) -> tuple[str, Any]:
    """A Jaeger key/value as (key, the value its type says)."""
    tag = _object(tag, where)
    key = _string(tag.get("key"), f"{where}.key")
    kind, value = tag.get("type", "string"), tag.get("value")
    field = f"{where} ({key})"
    if kind == "string":
        return key, _string(value, field)
    if kind == "bool" and isinstance(value, bool):
        return key, value
    if kind == "int64":
        return key, _int64(value, field)
    if kind == "float64" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return key, float(value)
    if kind == "binary" and isinstance(value, str):
        try:
            return key, base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            pass
    if kind not in ("string", "bool", "int64", "float64", "binary"):
        raise JaegerError(f"{where}.type: {kind!r} is not a Jaeger tag type (string, bool, "
                          "int64, float64, binary)")
    return _bad(field, value, kind)


def _bad(field: str, value: Any, kind: str) -> Any:
    raise JaegerError(f"{field}: {otlp_json.short(value)} is not a {kind} value")


def _put(attributes: Any, key: str, value: Any, where: str) -> None:
    """Add `key`: `value` to `attributes`, kvscope's keys retyped from Jaeger's forms."""
    try:
        value = otlp_json.decode_attribute(key, value)
    except otlp_json.OtlpJsonError as e:
        raise JaegerError(f"{where}: {e}") from None
    attribute = attributes.add()
    attribute.key = key
    otlp_json.set_value(attribute.value, value)


def _id(text: Any, size: int, where: str) -> bytes:
    """A Jaeger id: hex, zeros on the left left out (a 64-bit trace id is 16 characters)."""
    if not isinstance(text, str) or not 0 < len(text) <= 2 * size:
        raise JaegerError(f"{where}: {otlp_json.short(text)} is not an id (at most "
                          f"{2 * size} hex characters)")
    try:
        raw = otlp_json.id_bytes(text.rjust(2 * size, "0"), size, where)
    except otlp_json.OtlpJsonError as e:
        raise JaegerError(str(e)) from None
    if not any(raw):
        raise JaegerError(f"{where}: all zeros, the invalid id")
    return raw


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
        raise JaegerError(f"{where}: {otlp_json.short(value)} is not a whole number")
    return int(value)


def _microseconds(value: Any, where: str) -> int:
    """A Jaeger time or duration: whole microseconds, none negative, within kvscope's times."""
    number = _integer(value, where)
    if not 0 <= number <= MAX_TIME_US:
        raise JaegerError(f"{where}: {otlp_json.short(value)} is not a time in microseconds "
                          f"from 0 to {MAX_TIME_US} (the year 2262, the last kvscope holds)")
    return number


def _int64(value: Any, where: str) -> int:
    """An int64 tag's value: a number, or its digits (what Jaeger writes beyond JavaScript's
    2^53), in int64's range."""
    if isinstance(value, str) and _DIGITS.fullmatch(value):
        if len(value.lstrip("+-0")) > _INT64_DIGITS:  # more than int() may even convert
            raise _beyond_int64(value, where)
        value = int(value)
    number = _integer(value, where)
    if number not in otlp_json.INT64_RANGE:
        raise _beyond_int64(value, where)
    return number


def _beyond_int64(value: Any, where: str) -> JaegerError:
    return JaegerError(f"{where}: {otlp_json.short(value)} is beyond int64 "
                       f"({otlp_json.INT64_RANGE.start} to {otlp_json.INT64_RANGE.stop - 1})")


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise JaegerError(f"{where}: {otlp_json.short(value)} is not a string")
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise JaegerError(f"{where}: a JSON {otlp_json.json_type(value)} where an object "
                          "belongs")
    return value


def _array(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise JaegerError(f"{where}: a JSON {otlp_json.json_type(value)} where an array "
                          "belongs")
    return value


def _join(where: str, field: str) -> str:
    return f"{where}.{field}" if where else field

