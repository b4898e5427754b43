"""The columnar span table: a run's spans as one Arrow table, stored as RUN/spans.parquet.

Readers turn the OTLP JSON span files into this table once (analysis.spantable) and read the
table from then on. The tracer also writes each span file's own rows as a Parquet part beside it
(PARTS_DIR, `part_of`), which readers take instead of parsing the file while it is current. Its columns are semconv.SPAN_COLUMNS, except that the attribute keys
analysis reads have a typed column each, named by the key (TYPED_ATTRIBUTES); `attributes`
holds every other attribute of the span as JSON text ("" when none).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa

from kvscope.contract import semconv

_ARROW: dict[type, pa.DataType] = {str: pa.string(), int: pa.int64(), float: pa.float64(),
                                   bool: pa.bool_()}


def arrow_type(value_type: semconv.ValueType) -> pa.DataType:
    """The Arrow type of an attribute's declared value type (semconv.ATTRIBUTE_TYPES)."""
    scalar = _ARROW[value_type.scalar]
    return pa.list_(scalar) if value_type.array else scalar


# The attribute keys analysis reads, each typed as semconv.ATTRIBUTE_TYPES declares it (the
# reader, contract.otlp_json, hands every declared key over as its declared type).
ANALYSIS_KEYS = (
    semconv.REQUEST_ID, semconv.VLLM_REQUEST_ID, semconv.PHASE, semconv.CONCURRENCY,
    semconv.PROMPT_INDEX, semconv.READ_BYTES, semconv.READER_TIDS, semconv.READ_DEVICE,
    semconv.READ_CHUNK_SUBMIT_NS, semconv.READ_CHUNK_READY_NS, semconv.READ_EXTENT_CHUNK,
    semconv.READ_EXTENT_START, semconv.READ_EXTENT_END, semconv.HIT_TOKENS,
    semconv.PREFILL_TOKENS, semconv.VLLM_CACHED_TOKENS, semconv.GEN_AI_TTFT,
    semconv.GEN_AI_PROMPT_TOKENS, semconv.GEN_AI_COMPLETION_TOKENS, semconv.ERROR_TYPE,
    semconv.LEDGER_START, semconv.LEDGER_END, semconv.LEDGER_KEY, semconv.LEDGER_TIER,
    semconv.LEDGER_REASON, semconv.LEDGER_DETAIL, semconv.LEDGER_FACT_NS,
    semconv.LEDGER_STORED_NS, semconv.LEDGER_DIVERGED_AT, semconv.LEDGER_DROPPED,
)
TYPED_ATTRIBUTES: dict[str, pa.DataType] = {
    key: arrow_type(semconv.ATTRIBUTE_TYPES[key]) for key in ANALYSIS_KEYS}
REST = "attributes"  # JSON text of the span's other attributes
# SPAN_COLUMNS but `attributes`, in the order analysis.otlp's rows hold them
SPAN_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("trace_id", pa.string()), ("span_id", pa.string()), ("parent_span_id", pa.string()),
    ("name", pa.string()), ("start_ns", pa.int64()), ("end_ns", pa.int64()),
    ("request_id", pa.string()), ("service", pa.string()), ("pid", pa.int64()),
)
# Columns every span of a written table has a value in (cleaning drops a span whose request id
# its trace cannot give; a missing parent id is "")
FILLED = (*(name for name, _ in SPAN_FIELDS), REST)
SCHEMA = pa.schema([pa.field(name, kind) for name, kind in
                    (*SPAN_FIELDS, *TYPED_ATTRIBUTES.items(), (REST, pa.string()))])
# What makes two rows one span (cleaning keeps the first), and what an exact copy repeats too
SPAN_IDENTITY = ("trace_id", "span_id")
COPY_COLUMNS = (*SPAN_IDENTITY, "name", "start_ns", "end_ns")
# What analysis reads of every span besides the typed attributes (no ids: the table is clean)
ANALYSIS_COLUMNS = tuple(name for name, _ in SPAN_FIELDS if not name.endswith("_id")) + (
    "request_id",)
# Schema metadata keys of spans.parquet (JSON values).
META_FINGERPRINT = b"kvscope.spans.fingerprint"  # the span files and clock it was made from
META_PROBLEMS = b"kvscope.spans.problems"  # [str]: what loading the span files found wrong
META_NOTES = b"kvscope.spans.notes"  # {request_id: [str]}: problems with a request's spans

# A span file's part: its rows of the table (times in epoch ns: the run's clock offset is the
# reader's to subtract), written by the tracer beside the file as RUN/spans/parts/<stem>.parquet
# (a folder of its own: the *.json globs of spans/ and `kvscope import` of the folder never meet
# it). META_SOURCE says which span file it is of; a part is read only while it says so of the
# file as it is now (name, size and SHA-256 of its bytes).
PARTS_DIR = "parts"
META_SOURCE = b"kvscope.part.source"
_ENCODER = msgspec.json.Encoder()


def part_of(span_file: Path) -> Path:
    """Where the part of `span_file` (SPANS_DIR/NAME.json) is: SPANS_DIR/parts/NAME.parquet."""
    return span_file.parent / PARTS_DIR / f"{span_file.stem}.parquet"


def part_source(span_file: Path, document: bytes) -> bytes:
    """META_SOURCE of the part of `span_file` whose bytes are `document`: the value a part
    holds while it is current."""
    return json.dumps({"file": span_file.name, "bytes": len(document),
                       "sha256": hashlib.sha256(document).hexdigest()}).encode()


def rest_json(rest: dict[str, Any]) -> str:
    """The JSON text of attributes without a typed column ("" for none), as the table keeps
    them: msgspec's, or Python's where a value is NaN or infinite (msgspec writes null)."""
    if not rest:
        return ""
    if finite(rest):
        return _ENCODER.encode(rest).decode()
    return json.dumps(rest, default=str)


def rows_batch(rows: list[tuple]) -> pa.RecordBatch:
    """Span rows as one record batch of the table. A row holds semconv.SPAN_COLUMNS' values in
    their order, the attributes as a dict of plain values with kvscope's keys of their declared
    types (contract.otlp_json): what analysis.otlp reads from a span file, and what the tracer
    makes of its spans for a part."""
    columns: dict[str, list[Any]] = {name: [] for name in ("service", "pid", REST)}
    typed: dict[str, list[Any]] = {key: [None] * len(rows) for key in TYPED_ATTRIBUTES}
    for i, row in enumerate(rows):
        rest = {}
        for key, value in row[7].items():
            if key in typed:  # of its declared type: otlp_json made sure
                typed[key][i] = value
            else:
                rest[key] = value
        columns["service"].append(row[8])
        columns["pid"].append(row[9])
        columns[REST].append(rest_json(rest))
    # the row's values before its attributes, a column each
    base: list[Any] = list(zip(*rows))[:7] if rows else [[]] * 7
    arrays: dict[str, Any] = {name: values for (name, _), values in zip(SPAN_FIELDS, base)}
    arrays.update(columns)
    arrays.update(typed)
    return pa.RecordBatch.from_pydict(arrays, schema=SCHEMA)


def finite(value: Any) -> bool:
    """No float in `value` is NaN or infinite (such values need Python's json, not msgspec's)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(finite(v) for v in value)
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    return True
