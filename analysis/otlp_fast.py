"""A fast reader of the OTLP JSON span documents kvscope's tracer writes: msgspec, then columns.

It gives the span table's rows (contract.spantable.SCHEMA) of a document, the same as the
reader that defines the meaning (contract.otlp_json through protobuf, via analysis.otlp and
contract.spantable.rows_batch) for the documents it accepts; anything it is not sure of (a
field it does not know, snake_case names, bytes values, an id not in hex or all zeros, a number
written unusually, a kvscope attribute not already of its declared type, an enum name it does
not know) makes it give the document back (`None`), and the caller reads that document through
protobuf.

The work per span is kept out of Python: msgspec decodes into structs that the cyclic garbage
collector does not track (a document holds hundreds of thousands of them, and the collector's
passes over them took half the time), list comprehensions pull each field out, and Arrow checks
and converts whole columns (ids, times, integers) at once. Python touches a value only for the
attributes that land in the JSON text column and for arrays of untyped keys.
"""

from __future__ import annotations

import json
import operator
from typing import Any, Sequence

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from msgspec import UNSET, UnsetType

from kvscope.analysis.otlp import pid_of
from kvscope.contract import semconv
from kvscope.contract import spantable as spec

_KINDS = frozenset(f"SPAN_KIND_{k}" for k in (
    "UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER"))
# An AnyValue's fields as bits: which of them a value sets (protobuf refuses two at once).
_STRING, _BOOL, _INT, _DOUBLE, _ARRAY, _KVLIST, _BYTES = 1, 2, 4, 8, 16, 32, 64
_SCALAR_BIT = {str: _STRING, bool: _BOOL, int: _INT, float: _DOUBLE}
_SCALAR_FIELD = {_STRING: "stringValue", _BOOL: "boolValue", _DOUBLE: "doubleValue"}
_DECLARED = pa.array(list(semconv.ATTRIBUTE_TYPES), pa.string())
_TYPED = frozenset(spec.TYPED_ATTRIBUTES)


class _Unsure(Exception):
    """The document holds something only the protobuf reader interprets with certainty."""


class _AnyValue(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    stringValue: str | UnsetType = UNSET
    boolValue: bool | UnsetType = UNSET
    intValue: int | str | UnsetType = UNSET
    doubleValue: float | UnsetType = UNSET
    arrayValue: _ArrayValue | UnsetType = UNSET
    kvlistValue: _KvList | UnsetType = UNSET
    bytesValue: str | UnsetType = UNSET


class _KeyValue(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    key: str = ""
    value: _AnyValue = msgspec.field(default_factory=_AnyValue)  # absent: an empty value


class _ArrayValue(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    values: list[_AnyValue] = []


class _KvList(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    values: list[_KeyValue] = []


class _Span(msgspec.Struct, forbid_unknown_fields=True, gc=False):
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


class _ScopeSpans(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    scope: msgspec.Raw = msgspec.Raw(b"")
    spans: list[_Span] = []
    schemaUrl: msgspec.Raw = msgspec.Raw(b"")


class _Resource(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    attributes: list[_KeyValue] = []
    droppedAttributesCount: msgspec.Raw = msgspec.Raw(b"")


class _ResourceSpans(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    resource: _Resource = msgspec.field(default_factory=_Resource)
    scopeSpans: list[_ScopeSpans] = []
    schemaUrl: msgspec.Raw = msgspec.Raw(b"")


class _Request(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    resourceSpans: list[_ResourceSpans] = []


_DECODER = msgspec.json.Decoder(_Request)
_ENCODER = msgspec.json.Encoder()


def batch(document: bytes, offset_ns: int) -> pa.RecordBatch | None:
    """The span table's rows of one document (times minus `offset_ns`), or None when only
    protobuf can say."""
    try:
        return _batch(_DECODER.decode(document), offset_ns)
    except (msgspec.DecodeError, _Unsure):
        return None


def _batch(message: _Request, offset_ns: int) -> pa.RecordBatch:
    spans: list[_Span] = []
    services, pids, counts = [], [], []
    for resource_spans in message.resourceSpans:
        resource = {kv.key: _checked(kv.key, _value(kv.value))
                    for kv in resource_spans.resource.attributes}
        before = len(spans)
        for scope_spans in resource_spans.scopeSpans:
            spans += scope_spans.spans
        counts.append(len(spans) - before)
        services.append(str(resource.get(semconv.SERVICE_NAME, "")))
        pids.append(pid_of(resource.get(semconv.PROCESS_PID)))
    if any(isinstance(k, str) and k not in _KINDS for k in {s.kind for s in spans}):
        raise _Unsure
    n = len(spans)
    attributes = _attribute_columns(spans, n)
    fields = (  # the span fields in contract.spantable.SPAN_FIELDS' order
        _ids([s.traceId for s in spans], 32, required=True),
        _ids([s.spanId for s in spans], 16, required=True),
        _ids([s.parentSpanId for s in spans], 16, required=False),
        pa.array([s.name for s in spans], pa.string()),
        _times([s.startTimeUnixNano for s in spans], offset_ns),
        _times([s.endTimeUnixNano for s in spans], offset_ns),
        attributes[semconv.REQUEST_ID],
        pa.array(np.repeat(np.array(services, dtype=object), counts), pa.string()),
        pa.array(np.repeat(np.array(pids, dtype=np.int64), counts), pa.int64()),
    )
    columns: dict[str, Any] = {name: column for (name, _), column in
                               zip(spec.SPAN_FIELDS, fields, strict=True)}
    columns.update(attributes)
    return pa.RecordBatch.from_arrays([columns[f.name] for f in spec.SCHEMA], schema=spec.SCHEMA)


def _attribute_columns(spans: list[_Span], n: int) -> dict[str, pa.Array]:
    """A typed column per TYPED_ATTRIBUTES key and the JSON text of the other attributes."""
    per_span = np.array([len(s.attributes) for s in spans], dtype=np.int64)
    pairs = [kv for s in spans for kv in s.attributes]
    keys = [kv.key for kv in pairs]
    values = [kv.value for kv in pairs]
    owner = np.repeat(np.arange(n), per_span)
    kinds = _kinds(values)
    declared = pc.index_in(pa.array(keys, pa.string()), value_set=_DECLARED)
    codes = declared.fill_null(-1).to_numpy(zero_copy_only=False)
    out: dict[str, pa.Array] = {}
    rest = np.ones(len(pairs), dtype=bool)
    for code in np.unique(codes[codes >= 0]).tolist():
        key = _DECLARED[code].as_py()
        rows = np.flatnonzero(codes == code)
        typed = _typed(values, kinds, rows, semconv.ATTRIBUTE_TYPES[key])
        if key in _TYPED:
            rest[rows] = False
            out[key] = _scatter(typed, owner[rows], n)
    out[spec.REST] = _rest_text(keys, values, kinds, owner, np.flatnonzero(rest), n)
    absent = {key: pa.nulls(n).cast(kind) for key, kind in spec.TYPED_ATTRIBUTES.items()
              if key not in out}
    return {**out, **absent}


def _kinds(values: Sequence[_AnyValue]) -> np.ndarray:
    """Per value, the bits of the fields it sets; _Unsure for bytes or two fields at once."""
    u = UNSET
    kinds = np.array([(v.stringValue is not u) + 2 * (v.boolValue is not u)
                      + 4 * (v.intValue is not u) + 8 * (v.doubleValue is not u)
                      + 16 * (v.arrayValue is not u) + 32 * (v.kvlistValue is not u)
                      + 64 * (v.bytesValue is not u) for v in values], dtype=np.int64)
    if ((kinds & _BYTES) != 0).any() or ((kinds & (kinds - 1)) != 0).any():
        raise _Unsure
    return kinds


def _typed(values: list[_AnyValue], kinds: np.ndarray, rows: np.ndarray,
           declared: semconv.ValueType) -> pa.Array:
    """The values at `rows` (of one declared key) as an Arrow array of its type, null where a
    value is empty; _Unsure when one holds another type (otlp_json would convert it)."""
    bit = _ARRAY if declared.array else _SCALAR_BIT[declared.scalar]
    if ((kinds[rows] & ~bit) != 0).any():
        raise _Unsure
    held = rows[kinds[rows] != 0]
    position = np.full(len(rows), -1, dtype=np.int64)
    position[kinds[rows] != 0] = np.arange(len(held))
    picked = _pick(values, held)
    if declared.array:
        arrays = [v.arrayValue.values for v in picked]
        lengths = np.array([len(a) for a in arrays], dtype=np.int32)
        elements = [e for a in arrays for e in a]
        scalar = _SCALAR_BIT[declared.scalar]
        if (_kinds(elements) != scalar).any():
            raise _Unsure  # an element of another type, or an empty one
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
        found: pa.Array = pa.ListArray.from_arrays(offsets, _scalars(elements, scalar))
    else:
        found = _scalars(picked, bit)
    return gather(found, position)


def _scalars(values: list[_AnyValue], bit: int) -> pa.Array:
    """The scalar each value sets (all of kind `bit`), as an Arrow array."""
    if bit == _INT:
        return pa.array(_int64s([v.intValue for v in values]), pa.int64())
    field = operator.attrgetter(_SCALAR_FIELD[bit])
    kind = {_STRING: pa.string(), _BOOL: pa.bool_(), _DOUBLE: pa.float64()}[bit]
    return pa.array(list(map(field, values)), kind)


def _scatter(values: pa.Array, owner: np.ndarray, n: int) -> pa.Array:
    """A column of `n` spans holding each value at its owning span (the last, where a span
    repeats the key: a dict keeps the last value), null elsewhere."""
    last = np.ones(len(owner), dtype=bool)
    last[:-1] = owner[1:] != owner[:-1]  # a span's pairs are consecutive
    at = np.full(n, -1, dtype=np.int64)
    at[owner[last]] = np.flatnonzero(last)
    return gather(values, at)


def gather(values: pa.Array, at: np.ndarray) -> pa.Array:
    """values[at], null where `at` is negative."""
    return values.take(pa.array(at, pa.int64(), mask=at < 0))


def _rest_text(keys: list[str], values: list[_AnyValue], kinds: np.ndarray, owner: np.ndarray,
               rows: np.ndarray, n: int) -> pa.Array:
    """Per span, its attributes at `rows` (those without a typed column) as JSON text of a
    dict ("" when none), as contract.spantable.rest_json writes it."""
    python = _python_values(values, kinds, rows)
    finite = _finite_values(python, kinds[rows])
    owners = owner[rows]
    starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]]) if len(rows) else rows
    bounds = np.r_[starts, len(rows)].tolist()
    row_keys = _pick(keys, rows)
    dicts = [dict(zip(row_keys[a:b], python[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]
    clean = np.logical_and.reduceat(finite, starts) if len(rows) else np.ones(0, dtype=bool)
    text = np.full(n, "", dtype=object)
    encoded = _ENCODER.encode_lines([d for d, ok in zip(dicts, clean) if ok])
    text[owners[starts][clean]] = encoded.decode().split("\n")[:-1]
    for at, rest, ok in zip(owners[starts].tolist(), dicts, clean.tolist()):
        if not ok:
            text[at] = json.dumps(rest, default=str)
    return pa.array(text, pa.string())


def _python_values(values: list[_AnyValue], kinds: np.ndarray, rows: np.ndarray) -> list[Any]:
    """The plain Python value of each value at `rows` (what analysis.otlp's reader gives)."""
    out: list[Any] = [None] * len(rows)
    row_kinds = kinds[rows]
    for bit in np.unique(row_kinds).tolist():
        where = np.flatnonzero(row_kinds == bit)
        picked = _pick(values, rows[where])
        if bit == 0:
            continue
        if bit in _SCALAR_FIELD or bit == _INT:
            found = (_int64s([v.intValue for v in picked]).tolist() if bit == _INT
                     else list(map(operator.attrgetter(_SCALAR_FIELD[bit]), picked)))
        else:
            found = [_value(v) for v in picked]
        for i, value in zip(where.tolist(), found):
            out[i] = value
    return out


def _finite_values(python: list[Any], kinds: np.ndarray) -> np.ndarray:
    """Per value, whether it holds no NaN or infinity."""
    ok = np.ones(len(python), dtype=bool)
    for i in np.flatnonzero((kinds & (_DOUBLE | _ARRAY | _KVLIST)) != 0).tolist():
        ok[i] = spec.finite(python[i])
    return ok


def _pick(seq: Sequence[Any], at: np.ndarray) -> list[Any]:
    """seq[i] for each i of `at`, as a list."""
    if len(at) == 0:
        return []
    got = operator.itemgetter(*at.tolist())(seq)
    return list(got) if len(at) > 1 else [got]


def _checked(key: str, value: Any) -> Any:
    """`value` of attribute `key`; _Unsure when a declared key holds another type."""
    declared = semconv.ATTRIBUTE_TYPES.get(key)
    if declared is not None and value is not None and not declared.holds(value):
        raise _Unsure  # otlp_json converts it (or refuses the document)
    return value


def _value(value: _AnyValue) -> Any:
    """The Python value protobuf's reader gives for this AnyValue (analysis.otlp.any_value)."""
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


def _int64s(values: list[Any]) -> np.ndarray:
    """Integers written as decimal text (what OTLP JSON writes) or as numbers, as int64."""
    try:
        text = pa.array(values, pa.string())
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        return np.array([_int64(v) for v in values], dtype=np.int64)  # numbers, or a mix
    if not _every(pc.match_substring_regex(text, r"^-?[0-9]+$")):
        raise _Unsure
    try:
        return pc.cast(text, pa.int64()).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid:
        raise _Unsure from None  # out of int64's range


def _times(values: list[Any], offset_ns: int) -> pa.Array:
    """fixed64 times (never negative) minus the clock offset, as int64."""
    times = _int64s(values)
    if (times < 0).any():
        raise _Unsure
    try:
        return pc.subtract_checked(pa.array(times, pa.int64()), offset_ns)
    except pa.ArrowInvalid:
        raise _Unsure from None


def _ids(texts: list[str], hex_len: int, required: bool) -> pa.Array:
    """Ids written as OTLP hex, lower-cased ("" for a missing or all-zero optional one);
    anything else (base64, a missing or all-zero required id) is otlp_json's to read."""
    ids = pa.array(texts, pa.string())
    well = pc.match_substring_regex(ids, f"^[0-9a-fA-F]{{{hex_len}}}$")
    zero = pc.equal(ids, pa.scalar("0" * hex_len))
    if required:
        if not _every(well) or pc.any(zero).as_py():
            raise _Unsure
    else:
        if not _every(pc.or_(well, pc.equal(ids, pa.scalar("")))):
            raise _Unsure
        ids = pc.if_else(zero, "", ids)
    return pc.ascii_lower(ids)


def _every(mask: pa.Array) -> bool:
    return bool(pc.all(mask, min_count=0).as_py())
