"""OTLP/JSON, the format of every span file kvscope writes or reads, in one place.

Span files (RUN/spans/*.json), `kvscope export otlp`, the receiver of `kvscope record
--otlp-listen` and `kvscope import` all write the OTLP/JSON encoding of an
ExportTraceServiceRequest exactly (opentelemetry-proto, docs/specification.md, "JSON Protobuf
Encoding"): protobuf's JSON mapping (lowerCamelCase keys, 64-bit integers as decimal strings,
typed AnyValues) except that trace and span ids, on spans and on links, are lowercase hex
instead of base64, and enums are integers, never names. For messages protobuf's own JSON
support does the rest (`encode`), so only those two deviations are written here; the tracer,
which holds plain values and must not spend much CPU a span, writes values with `json_value`
(typed as the SDK's OTLP encoder types them; tests/tracer/test_pipeline.py checks the two
agree).

Reading is for documents from anywhere, so it accepts what real senders write and refuses the
rest field by field: ids in hex of either case or in protobuf's base64 (the two cannot be
confused: 16 bytes are 32 hex or 24 base64 characters), enum names or numbers, unknown fields
(ignored, as the specification requires of receivers), and the values of kvscope's attribute
keys in the forms trace backends give back (Jaeger keeps an array as its JSON text, a large
integer as a decimal string), each restored to the type semconv.ATTRIBUTE_TYPES declares.
Whatever cannot be read raises OtlpJsonError, one line naming the field.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Iterable, Iterator

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from kvscope.contract import semconv

Request = trace_service_pb2.ExportTraceServiceRequest
TRACE_ID_BYTES = 16
SPAN_ID_BYTES = 8
# kvscope's tables hold span times as int64 nanoseconds (OTLP's fixed64 goes on to 2^64-1): a
# later time is refused where a document is read, not met as an overflow in analysis.
MAX_TIME_NS = 2**63 - 1
INT64_RANGE = range(-2**63, 2**63)  # OTLP's intValue
# The id fields of a span and of a link (hex in OTLP/JSON), with their sizes; parentSpanId is
# the only optional one.
SPAN_IDS = {"traceId": TRACE_ID_BYTES, "spanId": SPAN_ID_BYTES, "parentSpanId": SPAN_ID_BYTES}
LINK_IDS = {"traceId": TRACE_ID_BYTES, "spanId": SPAN_ID_BYTES}
_OPTIONAL_IDS = frozenset({"parentSpanId"})
# Keys the specification forbids (original protobuf field names) where kvscope would otherwise
# miss ids to convert: refused rather than half read.
_SNAKE_KEYS = {"resource_spans": "resourceSpans", "scope_spans": "scopeSpans",
               "trace_id": "traceId", "span_id": "spanId", "parent_span_id": "parentSpanId"}
_SCALAR_FIELD = {str: "string_value", int: "int_value", float: "double_value",
                 bool: "bool_value"}
_INTEGER = re.compile(r"[+-]?[0-9]+")
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}  # protobuf's JSON words


class OtlpJsonError(ValueError):
    """A document or value that is not OTLP/JSON as kvscope reads it; the message names the
    field and what was found."""


class TimeRangeError(OtlpJsonError):
    """A span time past what kvscope's tables hold (int64 ns): a reader of a run refuses the
    file rather than skipping it as a document of another kind."""


# --- ids ------------------------------------------------------------------------------------

def hex_id(raw: bytes) -> str:
    """An id as OTLP/JSON writes it: lowercase hex ("" for no id)."""
    return raw.hex()


def hex_of(number: int, size: int) -> str:
    """An id the OpenTelemetry API holds as an int, as OTLP/JSON writes one of `size` bytes."""
    return f"{number:0{2 * size}x}"


def id_bytes(text: Any, size: int, field: str) -> bytes:
    """An id written as hex (either case) or as protobuf JSON's base64, as its `size` bytes;
    absent or "" is b"". OtlpJsonError names `field` otherwise."""
    if text is None or text == "":
        return b""
    if not isinstance(text, str):
        raise OtlpJsonError(f"{field}: {short(text)} is not an id (a string of "
                            f"{2 * size} hex characters)")
    raw = None
    if len(text) == 2 * size and all(c in "0123456789abcdefABCDEF" for c in text):
        raw = bytes.fromhex(text)
    else:
        try:
            decoded = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            decoded = b""
        raw = decoded if len(decoded) == size else None
    if raw is None:
        raise OtlpJsonError(f"{field}: {short(text)} is not an id of {size} bytes "
                            f"({2 * size} hex characters)")
    return raw


# --- values ---------------------------------------------------------------------------------

def any_value(value: common_pb2.AnyValue) -> Any:
    """An AnyValue as the plain Python value it carries (None when empty)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def set_value(target: common_pb2.AnyValue, value: Any) -> None:
    """Fill `target` with `value` typed as OTLP types it (bool before int: a bool is an int in
    Python); a list becomes an array, a dict a key-value list, None leaves it empty."""
    if value is None:
        return
    if isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        target.int_value = value
    elif isinstance(value, float):
        target.double_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, bytes):
        target.bytes_value = value
    elif isinstance(value, (list, tuple)):
        array = target.array_value
        array.SetInParent()
        for item in value:
            set_value(array.values.add(), item)
    elif isinstance(value, dict):
        kvlist = target.kvlist_value
        kvlist.SetInParent()
        for key, item in value.items():
            entry = kvlist.values.add()
            entry.key = str(key)
            set_value(entry.value, item)
    else:
        raise OtlpJsonError(f"{short(value)} ({type(value).__name__}) is no OTLP value")


def decode_attribute(key: str, value: Any) -> Any:
    """`value` of attribute `key` as the type semconv.ATTRIBUTE_TYPES declares for it: an array
    kept as its JSON text is parsed, an integer kept as a decimal string or an integral float
    becomes an int, an int becomes a float where a float is declared, "true" / "false" a bool.
    Keys kvscope does not declare come back unchanged. OtlpJsonError when `value` cannot be
    the declared type."""
    declared = semconv.ATTRIBUTE_TYPES.get(key)
    if declared is None:
        return value
    try:
        if not declared.array:
            return _scalar(declared.scalar, value)
        items = json.loads(value) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ValueError
        return [_scalar(declared.scalar, item) for item in items]
    except (ValueError, TypeError, RecursionError):
        raise OtlpJsonError(f"attribute {key}: {short(value)} is not "
                            f"{_describe(declared)}") from None


def _scalar(kind: type, value: Any) -> Any:
    if kind is int:
        return _int64(value)
    if isinstance(value, kind):
        return value
    if kind is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        return float(value)
    if kind is bool and value in ("true", "false"):
        return value == "true"
    raise ValueError(value)


def _int64(value: Any) -> int:
    """`value` as an OTLP intValue: an int, an integral float or a decimal string, in range."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        value = int(value)  # ValueError past Python's digits limit, as for any bad value
    if isinstance(value, bool) or not isinstance(value, int) or value not in INT64_RANGE:
        raise ValueError(value)
    return value


def _describe(declared: semconv.ValueType) -> str:
    if declared.array:
        name = {str: "string", int: "integer", float: "number", bool: "boolean"}[declared.scalar]
        return f"an array of {name}s"
    return {str: "a string", int: "an integer (int64)", float: "a number",
            bool: "a boolean"}[declared.scalar]


def _has_type(value: common_pb2.AnyValue, declared: semconv.ValueType) -> bool:
    field = _SCALAR_FIELD[declared.scalar]
    if not declared.array:
        return value.WhichOneof("value") == field
    return value.WhichOneof("value") == "array_value" and all(
        item.WhichOneof("value") == field for item in value.array_value.values)


def attributes(key_values: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    """Key-values as a dict of plain values, kvscope's keys as their declared types."""
    return {kv.key: decode_attribute(kv.key, any_value(kv.value)) for kv in key_values}


def restore_types(key_values: Iterable[common_pb2.KeyValue], where: str) -> None:
    """Retype in place every kvscope key whose value a backend stored as another type."""
    for kv in key_values:
        declared = semconv.ATTRIBUTE_TYPES.get(kv.key)
        if declared is None or _has_type(kv.value, declared):
            continue
        try:
            value = decode_attribute(kv.key, any_value(kv.value))
        except OtlpJsonError as e:
            raise OtlpJsonError(f"{where}: {e}") from None
        kv.value.Clear()
        set_value(kv.value, value)


# --- documents ------------------------------------------------------------------------------

def spans(request: Request) -> Iterator[trace_pb2.Span]:
    """Every span of `request`."""
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            yield from scope_spans.spans


def encode(request: Request) -> dict[str, Any]:
    """`request` as an OTLP/JSON document (a dict for json.dumps)."""
    document = json_format.MessageToDict(request, use_integers_for_enums=True)
    for resource_spans in document.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _hex_ids(span, SPAN_IDS)
                for link in span.get("links", ()):
                    _hex_ids(link, LINK_IDS)
    return document


def json_value(value: Any) -> dict[str, Any]:
    """A Python value as an OTLP/JSON AnyValue, typed the way the OpenTelemetry SDK's OTLP
    encoder types it (bool before int, bytes before sequences), for writers that hold plain
    values rather than messages: protobuf's JSON mapping costs the tracer's exporter thread
    over 100 µs a span."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, int):
        return {"intValue": str(int(value))}  # an IntEnum's str() is its name
    if isinstance(value, float):
        return {"doubleValue": value if math.isfinite(value) else _NON_FINITE[str(value)]}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode()}
    if isinstance(value, (tuple, list)) or isinstance(value, Sequence):  # ABC checks are slow
        return {"arrayValue": {"values": [json_value(v) for v in value]} if value else {}}
    if isinstance(value, (dict, Mapping)):
        return {"kvlistValue": {"values": json_attributes(value)} if value else {}}
    raise OtlpJsonError(f"{short(value)} ({type(value).__name__}) is no OTLP value")


def json_attributes(attributes: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Key-values as OTLP/JSON writes them."""
    return [{"key": str(key), "value": json_value(value)} for key, value in attributes.items()]


def dumps(request: Request) -> str:
    """`request` as compact OTLP/JSON text (a span file)."""
    return json.dumps(encode(request), separators=(",", ":"))


def _hex_ids(item: dict[str, Any], fields: dict[str, int]) -> None:
    for key in fields:
        if key in item:
            item[key] = base64.b64decode(item[key]).hex()


def loads(text: str | bytes) -> Request:
    """An OTLP/JSON document's text as a message (OtlpJsonError for anything else)."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise OtlpJsonError(f"not valid JSON at line {e.lineno} ({e.msg})") from None
    except RecursionError:
        raise OtlpJsonError("JSON nested too deeply to be a trace document") from None
    except UnicodeDecodeError as e:
        raise OtlpJsonError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    return decode(document)


def decode(document: Any) -> Request:
    """An OTLP/JSON document (parsed JSON) as an ExportTraceServiceRequest; see the module's
    docstring for what is accepted. OtlpJsonError names the first field that is not."""
    request = Request()
    for i, resource_spans in enumerate(_items(document, "resourceSpans", "")):
        where = f"resourceSpans[{i}]"
        target = request.resource_spans.add()
        _parse(_without(resource_spans, "scopeSpans"), target, where)
        restore_types(target.resource.attributes, f"{where}.resource.attributes")
        for j, scope_spans in enumerate(_items(resource_spans, "scopeSpans", where)):
            scope_where = f"{where}.scopeSpans[{j}]"
            scope_target = target.scope_spans.add()
            _parse(_without(scope_spans, "spans"), scope_target, scope_where)
            for k, span in enumerate(_items(scope_spans, "spans", scope_where)):
                span_where = f"{scope_where}.spans[{k}]"
                span_target = scope_target.spans.add()
                _parse(_span_with_base64_ids(span, span_where), span_target, span_where)
                _check_times(span_target, span_where)
                restore_types(span_target.attributes, f"{span_where} ({span_target.name!r})")
    return request


def _check_times(span: trace_pb2.Span, where: str) -> None:
    for field, value in (("startTimeUnixNano", span.start_time_unix_nano),
                         ("endTimeUnixNano", span.end_time_unix_nano)):
        if value > MAX_TIME_NS:
            raise TimeRangeError(f"{where}.{field}: {value} is later than kvscope's times reach "
                                f"({MAX_TIME_NS} ns after 1970, in the year 2262)")


def _items(container: Any, key: str, where: str) -> list[Any]:
    """container[key] as a list of objects ([] when absent), after checking the shapes
    (`where`: the container's path, "" for the document)."""
    if not isinstance(container, dict):
        raise OtlpJsonError(f"{where or 'the document'}: a JSON {json_type(container)} where "
                            f"an object belongs")
    for snake, camel in _SNAKE_KEYS.items():
        if snake in container:
            raise OtlpJsonError(f"{where or 'the document'}: key {snake!r}; OTLP/JSON keys are "
                                f"lowerCamelCase ({camel!r})")
    items = container.get(key)
    path = f"{where}.{key}" if where else key
    if items is None:
        return []
    if not isinstance(items, list):
        raise OtlpJsonError(f"{path}: a JSON {json_type(items)} where an array belongs")
    for n, item in enumerate(items):
        if not isinstance(item, dict):
            raise OtlpJsonError(f"{path}[{n}]: a JSON {json_type(item)} where an object "
                                f"belongs")
    return items


def _without(item: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k != key}


def _span_with_base64_ids(span: dict[str, Any], where: str) -> dict[str, Any]:
    """A copy of `span` whose ids (and its links' ids) protobuf's JSON parser reads as the
    right bytes."""
    links = _items(span, "links", where)
    out = _base64_ids(span, SPAN_IDS, where)
    if links:
        out["links"] = [_base64_ids(link, LINK_IDS, f"{where}.links[{n}]")
                        for n, link in enumerate(links)]
    return out


def _base64_ids(item: dict[str, Any], fields: dict[str, int], where: str) -> dict[str, Any]:
    out = dict(item)
    for key, size in fields.items():
        raw = id_bytes(item.get(key), size, f"{where}.{key}")
        if key in _OPTIONAL_IDS and not any(raw):
            raw = b""  # some senders write a root's parent as zeros
        elif not raw:
            raise OtlpJsonError(f"{where}.{key}: missing (every span and link has a "
                                f"{size}-byte {key})")
        elif not any(raw):
            raise OtlpJsonError(f"{where}.{key}: all zeros, the invalid id")
        out[key] = base64.b64encode(raw).decode()
    return out


def _parse(item: dict[str, Any], target: Any, where: str) -> None:
    try:
        json_format.ParseDict(item, target, ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise OtlpJsonError(_parse_reason(str(e), where)) from None
    except OverflowError:  # protobuf's enum conversion meets infinity uncaught
        raise OtlpJsonError(f"{where}: an infinite number (or one of too many digits) where "
                            "an enum belongs (kind, status.code)") from None
    except RecursionError:
        raise OtlpJsonError(f"{where}: values nested too deeply") from None


def _parse_reason(message: str, where: str) -> str:
    """protobuf's ParseError text ("Failed to parse a field: Failed to parse b field: why at
    Message.a[0].b.") as "<where>.a[0].b: why"."""
    path = ""
    if " at " in message:
        message, _, located = message.rpartition(" at ")
        path = located.rstrip(".").partition(".")[2]
    reason = message.rpartition(" field: ")[2].rstrip(".")
    path = path or ".".join(re.findall(r"Failed to parse (\w+) field", message))
    return f"{where}.{path}: {reason}" if path else f"{where}: {reason}"


def json_type(value: Any) -> str:
    """What `value` (parsed JSON) is, in JSON's words, for messages."""
    return {dict: "object", list: "array", str: "string", bool: "boolean",
            type(None): "null"}.get(type(value), "number")


def short(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters for a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."
