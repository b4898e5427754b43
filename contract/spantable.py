"""The columnar span table: a run's spans as one Arrow table, stored as RUN/spans.parquet.

Readers turn the OTLP JSON span files into this table once (analysis.spantable) and read the
table from then on. Its columns are semconv.SPAN_COLUMNS, except that the attribute keys
analysis reads have a typed column each, named by the key (TYPED_ATTRIBUTES); `attributes`
holds every other attribute of the span as JSON text ("" when none).
"""

from __future__ import annotations

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
