"""A fast reader of the OTLP JSON span documents kvscope's tracer writes, with msgspec.

It yields the same rows as analysis.otlp (contract.otlp_json through protobuf, which defines
the meaning) for the documents it accepts, many times faster; anything it is not sure of (a
field it does not know, snake_case names, bytes values, an id not in hex or all zeros, a
number written unusually, a kvscope attribute not already of its declared type, an enum name
it does not know) makes it give the document back (`None`), and the caller reads that
document with analysis.otlp.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from kvscope.contract import semconv
from kvscope.analysis.otlp import pid_of

_HEX = frozenset("0123456789abcdefABCDEF")
_KINDS = frozenset(f"SPAN_KIND_{k}" for k in (
    "UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER"))


class _Unsure(Exception):
    """The document holds something only the protobuf reader interprets with certainty."""


class _AnyValue(msgspec.Struct, forbid_unknown_fields=True):
    stringValue: str | UnsetType = UNSET
    boolValue: bool | UnsetType = UNSET
    intValue: int | str | UnsetType = UNSET
    doubleValue: float | UnsetType = UNSET
    arrayValue: _ArrayValue | UnsetType = UNSET
    kvlistValue: _KvList | UnsetType = UNSET
    bytesValue: str | UnsetType = UNSET


class _KeyValue(msgspec.Struct, forbid_unknown_fields=True):
    key: str = ""
    value: _AnyValue | UnsetType = UNSET


class _ArrayValue(msgspec.Struct, forbid_unknown_fields=True):
    values: list[_AnyValue] = []


class _KvList(msgspec.Struct, forbid_unknown_fields=True):
    values: list[_KeyValue] = []


class _Span(msgspec.Struct, forbid_unknown_fields=True):
    traceId: str = ""
    spanId: str = ""
    traceState: msgspec.Raw = msgspec.Raw(b"")
    parentSpanId: str = ""
    flags: msgspec.Raw = msgspec.Raw(b"")
    name: str = ""
    kind: int | str = 0
    startTimeUnixNano: int | str = 0
    endTimeUnixNano: int | str = 0
    attributes: list[_KeyValue] = []
    droppedAttributesCount: msgspec.Raw = msgspec.Raw(b"")
    events: msgspec.Raw = msgspec.Raw(b"")
    droppedEventsCount: msgspec.Raw = msgspec.Raw(b"")
    links: msgspec.Raw = msgspec.Raw(b"")
    droppedLinksCount: msgspec.Raw = msgspec.Raw(b"")
    status: msgspec.Raw = msgspec.Raw(b"")


class _ScopeSpans(msgspec.Struct, forbid_unknown_fields=True):
    scope: msgspec.Raw = msgspec.Raw(b"")
    spans: list[_Span] = []
    schemaUrl: msgspec.Raw = msgspec.Raw(b"")


class _Resource(msgspec.Struct, forbid_unknown_fields=True):
    attributes: list[_KeyValue] = []
    droppedAttributesCount: msgspec.Raw = msgspec.Raw(b"")


class _ResourceSpans(msgspec.Struct, forbid_unknown_fields=True):
    resource: _Resource = msgspec.field(default_factory=_Resource)
    scopeSpans: list[_ScopeSpans] = []
    schemaUrl: msgspec.Raw = msgspec.Raw(b"")


class _Request(msgspec.Struct, forbid_unknown_fields=True):
    resourceSpans: list[_ResourceSpans] = []


_DECODER = msgspec.json.Decoder(_Request)


def rows(document: bytes, offset_ns: int) -> list[tuple] | None:
    """analysis.otlp's span rows of one document, or None when only protobuf can say."""
    try:
        message = _DECODER.decode(document)
        return _rows(message, offset_ns)
    except (msgspec.DecodeError, _Unsure, ValueError):
        return None


def _rows(message: _Request, offset_ns: int) -> list[tuple]:
    out = []
    for resource_spans in message.resourceSpans:
        resource = _attributes(resource_spans.resource.attributes)
        service = str(resource.get(semconv.SERVICE_NAME, ""))
        pid = pid_of(resource.get(semconv.PROCESS_PID))
        for scope_spans in resource_spans.scopeSpans:
            for span in scope_spans.spans:
                if isinstance(span.kind, str) and span.kind not in _KINDS:
                    raise _Unsure
                attributes = _attributes(span.attributes)
                request_id = attributes.get(semconv.REQUEST_ID)
                out.append((
                    _hex(span.traceId, 32, True), _hex(span.spanId, 16, True),
                    _hex(span.parentSpanId, 16, False),
                    span.name, _fixed64(span.startTimeUnixNano) - offset_ns,
                    _fixed64(span.endTimeUnixNano) - offset_ns,
                    None if request_id is None else str(request_id), attributes, service, pid,
                ))
    return out


def _attributes(pairs: list[_KeyValue]) -> dict[str, Any]:
    out = {}
    for kv in pairs:
        value = _value(kv.value)
        declared = semconv.ATTRIBUTE_TYPES.get(kv.key)
        if declared is not None and value is not None and not _is(value, declared):
            raise _Unsure  # otlp_json converts it (or refuses the document)
        out[kv.key] = value
    return out


def _is(value: Any, declared: semconv.ValueType) -> bool:
    """`value` already has the declared type (a bool is no int here, as in otlp_json)."""
    if not declared.array:
        return type(value) is declared.scalar
    return type(value) is list and all(type(v) is declared.scalar for v in value)


def _value(value: _AnyValue | UnsetType) -> Any:
    """The Python value protobuf's reader gives for this AnyValue (analysis.otlp.any_value)."""
    if value is UNSET:
        return None
    found = [v for v in (value.stringValue, value.boolValue, value.intValue, value.doubleValue,
                         value.arrayValue, value.kvlistValue) if v is not UNSET]
    if value.bytesValue is not UNSET or len(found) > 1:
        raise _Unsure  # bytes, or a oneof set twice (protobuf refuses the document)
    if not found:
        return None
    (got,) = found
    if got is value.intValue:
        return _int64(got)
    if isinstance(got, _ArrayValue):
        return [_value(v) for v in got.values]
    if isinstance(got, _KvList):
        return {kv.key: _value(kv.value) for kv in got.values}
    return got


def _int64(value: int | str) -> int:
    if isinstance(value, str):
        digits = value.removeprefix("-")
        if not (digits.isascii() and digits.isdigit()):
            raise _Unsure
        value = int(value)
    if not -2**63 <= value < 2**63:
        raise _Unsure
    return value


def _fixed64(value: int | str) -> int:
    number = _int64(value)
    if number < 0:
        raise _Unsure
    return number


def _hex(text: str, hex_len: int, required: bool) -> str:
    """An id written as OTLP hex, lower-cased ("" for a missing or all-zero optional one);
    anything else (base64, a missing or all-zero required id) is otlp_json's to read."""
    if len(text) != hex_len or not set(text) <= _HEX:
        if text or required:
            raise _Unsure
        return ""
    if not text.strip("0"):
        if required:
            raise _Unsure
        return ""
    return text.lower()


def finite(value: Any) -> bool:
    """No float in `value` is NaN or infinite (such values need Python's json, not msgspec's)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(finite(v) for v in value)
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    return True
