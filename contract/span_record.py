"""One span as a serving thread records it, and as the exporter process reads it back.

A record is a fixed-width header (ids, CLOCK_MONOTONIC times, the span's name as an index into
NAMES, its kind and flags) followed by the caller's values marshalled in one call: the request
ids, the attribute mapping as the caller built it, and, rarely, what few spans have (events, an
error status, a name outside NAMES, the caller's tracestate). Records are 8-byte aligned. The
checksum covers the values and is seeded from the header's ids and times, so a reader on a CPU
that may show the ring's head before the record's bytes (weakly ordered memory) sees a record
that does not check yet and reads it again later, instead of a torn span.

Besides spans, two marks ride in the same rings: FIRST_TOKEN (the API server's first token of
a request, which starts the tail-sampling decision for its trace) and ERRORS (the process's
kvscope error counts, which replace a stats file the serving process no longer writes).
"""

from __future__ import annotations

import marshal
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvscope.contract import semconv

# length (u32, padded), name (u16 index into NAMES), kind (u8), flags (u8), trace id (two u64),
# span id, parent span id (u64), start, end (i64 CLOCK_MONOTONIC ns), checksum (u32) and
# length (u32) of the values
HEADER = struct.Struct("<IHBBQQQQqqII")
ALIGN = 8
PREFIX = struct.Struct("<IHBB")  # what a reader needs to skip a record (and all a pad has)
NAMES = (
    semconv.SPAN_SERVER_REQUEST, semconv.SPAN_QUEUE, semconv.SPAN_KV_LOOKUP,
    semconv.SPAN_KV_LOAD, semconv.SPAN_STORAGE_READ, semconv.SPAN_KV_TRANSFER,
    semconv.SPAN_PREFILL, semconv.SPAN_KV_STORE, semconv.SPAN_KV_LEDGER,
    semconv.SPAN_FIRST_TOKEN, semconv.SPAN_CLIENT_REQUEST,
)
NAME_INDEX = {name: index for index, name in enumerate(NAMES)}
NAME_IN_VALUES = 0xFFFF  # the name is `extra["name"]`

# kind: OTLP's Span.SpanKind numbers for spans, and kvscope's marks above them
INTERNAL, SERVER, CLIENT = 1, 2, 3
MARK_FIRST_TOKEN = 0xF0  # start_ns: the request's arrival, end_ns: its first token
MARK_ERRORS = 0xF1  # values: (None, None, {where: count}, None), the process's totals so far
PAD = 0xFF  # fills the ring's end when a record does not fit there

# flags
PARENT_REMOTE = 0x01  # the parent came from another process (OTLP's SpanFlags is-remote)
ERROR = 0x02  # status ERROR; its message, if any, is extra["status"]


class RecordError(ValueError):
    """Bytes that are not (yet) a whole record: a short buffer, or a checksum that fails."""


def checksum(values: bytes, trace_lo: int, span_id: int, start_ns: int, end_ns: int) -> int:
    return zlib.crc32(values, (trace_lo ^ span_id ^ start_ns ^ end_ns) & 0xFFFFFFFF)


def padded(length: int) -> int:
    return (length + ALIGN - 1) & ~(ALIGN - 1)


@dataclass
class SpanRecord:
    """A record read back: a span (kind < MARK_FIRST_TOKEN) or a mark."""

    name: str
    kind: int
    flags: int
    trace_id: int
    span_id: int
    parent_span_id: int  # 0: a root
    start_ns: int  # CLOCK_MONOTONIC of the writing host
    end_ns: int
    request_id: str | None
    vllm_request_id: str | None
    attributes: Mapping[str, Any]
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_span(self) -> bool:
        return self.kind < MARK_FIRST_TOKEN


def decode(buffer: memoryview) -> tuple[SpanRecord, int]:
    """The record at the start of `buffer` and its padded length; RecordError when the buffer
    does not hold a whole, checking record."""
    if len(buffer) < HEADER.size:
        raise RecordError(f"{len(buffer)} bytes hold no record header")
    (length, name, kind, flags, trace_hi, trace_lo, span_id, parent, start, end, crc,
     size) = HEADER.unpack_from(buffer)
    if (length < HEADER.size or length > len(buffer) or length % ALIGN
            or size > length - HEADER.size):
        raise RecordError(f"record length {length} does not fit the {len(buffer)} bytes left")
    values = bytes(buffer[HEADER.size:HEADER.size + size])
    if checksum(values, trace_lo, span_id, start, end) != crc:
        raise RecordError("record checksum does not match (not yet written, or damaged)")
    try:
        decoded = marshal.loads(values)
        request_id, vllm_request_id, attributes, extra = decoded
    except (ValueError, EOFError, TypeError) as e:
        raise RecordError(f"record values unreadable: {e}") from None
    extra = extra or {}
    if name != NAME_IN_VALUES and name >= len(NAMES) or name == NAME_IN_VALUES and not isinstance(
            extra.get("name"), str):
        raise RecordError(f"record name {name} is not one of the {len(NAMES)} known")
    return SpanRecord(
        name=extra["name"] if name == NAME_IN_VALUES else NAMES[name], kind=kind, flags=flags,
        trace_id=(trace_hi << 64) | trace_lo, span_id=span_id, parent_span_id=parent,
        start_ns=start, end_ns=end, request_id=request_id, vllm_request_id=vllm_request_id,
        attributes=attributes or {}, extra=extra), length
