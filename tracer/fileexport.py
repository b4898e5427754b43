# SPDX-License-Identifier: Apache-2.0
"""A span exporter that writes each batch as one OTLP JSON document into a directory.

One file per batch (not one per process) because vLLM's worker processes can be killed at
shutdown: whatever was exported before is already safe on disk. Files are written to a
temporary name and renamed, so a reader never sees half a document.

The document is built straight from the SDK's spans with contract.otlp_json's value encoding,
field for field what the SDK's OTLP encoder (encode_spans) puts in its message; going through
that message and protobuf's JSON mapping cost the exporter thread about 230 µs of CPU a span
on the 2-core VM, this about 25 (bench/tracing_overhead.py, tests/tracer/test_pipeline.py
checks the two agree).

Beside each file it writes that file's rows of the span table (contract.spantable) as a Parquet
part, made straight from the same spans: a reader takes the part instead of parsing the file
(analysis.spanstream), which is most of the cost of loading a run. The rows are the reader's
rows of the file, value for value: each attribute value is taken as the reader gets it back
from the JSON and typed by contract.otlp_json's own decode_attribute, and the rows go through
contract.spantable.rows_batch, as the reader's do. A batch the reader would read otherwise
than that (an id of zeros, a time past int64 ns, a kvscope attribute that is no value of its
declared type, a value json_value writes as another type) gets no part: its file is parsed.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext, SpanKind

from kvscope.contract import files, otlp_json, semconv
from kvscope.contract import spantable as table
from kvscope.tracer import failsafe

_KIND = {SpanKind.INTERNAL: 1, SpanKind.SERVER: 2, SpanKind.CLIENT: 3, SpanKind.PRODUCER: 4,
         SpanKind.CONSUMER: 5}  # OTLP's Span.SpanKind numbers
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # OTLP's SpanFlags
TRACE, SPAN = otlp_json.TRACE_ID_BYTES, otlp_json.SPAN_ID_BYTES


def span_file(spans: Sequence[ReadableSpan]) -> str:
    """The text of one span file holding `spans`, grouped by resource and scope (by identity:
    a provider's spans share its objects, and hashing a Resource serialises it to JSON)."""
    resources: dict[int, Any] = {}
    scopes: dict[int, Any] = {}
    grouped: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for span in spans:
        resources.setdefault(id(span.resource), span.resource)
        scopes.setdefault(id(span.instrumentation_scope), span.instrumentation_scope)
        grouped.setdefault(id(span.resource), {}).setdefault(
            id(span.instrumentation_scope), []).append(_span(span))
    document = {"resourceSpans": [
        {"resource": {"attributes": otlp_json.json_attributes(resources[r].attributes)},
         "scopeSpans": [{"scope": _scope(scopes[s]), "spans": encoded}
                        for s, encoded in by_scope.items()],
         **({"schemaUrl": resources[r].schema_url} if resources[r].schema_url else {})}
        for r, by_scope in grouped.items()]}
    return json.dumps(document, separators=(",", ":"))


def _scope(scope: Any) -> dict[str, Any]:
    if scope is None:
        return {}
    return {key: value for key, value in (("name", scope.name), ("version", scope.version))
            if value}


def _span(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    out: dict[str, Any] = {"traceId": otlp_json.hex_of(context.trace_id, TRACE),
                           "spanId": otlp_json.hex_of(context.span_id, SPAN)}
    if context.trace_state:
        out["traceState"] = ",".join(f"{k}={v}" for k, v in context.trace_state.items())
    if span.parent is not None:
        out["parentSpanId"] = otlp_json.hex_of(span.parent.span_id, SPAN)
    out.update(name=span.name, kind=_KIND[span.kind], startTimeUnixNano=str(span.start_time),
               endTimeUnixNano=str(span.end_time))
    if span.attributes:
        out["attributes"] = otlp_json.json_attributes(span.attributes)
    if span.events:
        out["events"] = [{"timeUnixNano": str(e.timestamp), "name": e.name,
                          **({"attributes": otlp_json.json_attributes(e.attributes)}
                             if e.attributes else {})} for e in span.events]
    if span.links:
        out["links"] = [{"traceId": otlp_json.hex_of(link.context.trace_id, TRACE),
                         "spanId": otlp_json.hex_of(link.context.span_id, SPAN),
                         **({"attributes": otlp_json.json_attributes(link.attributes)}
                            if link.attributes else {}),
                         "flags": _flags(link.context)} for link in span.links]
    status: dict[str, Any] = {}
    if span.status.status_code.value:
        status["code"] = span.status.status_code.value
    if span.status.description:
        status["message"] = span.status.description
    out["status"] = status
    for key, dropped in (("droppedAttributesCount", span.dropped_attributes),
                         ("droppedEventsCount", span.dropped_events),
                         ("droppedLinksCount", span.dropped_links)):
        if dropped:
            out[key] = dropped
    out["flags"] = _flags(span.parent)
    return out


def _flags(parent: SpanContext | None) -> int:
    return _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)


class _NoPart(Exception):
    """A span the reader of its file reads otherwise than the part's rows would say."""


def part_rows(spans: Sequence[ReadableSpan]) -> pa.RecordBatch | None:
    """The span table's rows of `span_file(spans)` as its reader makes them (times in epoch
    ns), straight from the spans; None where the reader would not read them so (it skips the
    document, or converts a value): then there is no part, and the file is parsed."""
    processes: dict[int, tuple[str, int]] = {}
    rows = []
    try:
        for span in spans:
            process = processes.get(id(span.resource))
            if process is None:
                process = processes[id(span.resource)] = _process(span.resource.attributes)
            rows.append(_row(span, process))
        return table.rows_batch(rows)
    except (_NoPart, ValueError, pa.ArrowException):  # OtlpJsonError is a ValueError
        return None


def _process(resource: Mapping[str, Any]) -> tuple[str, int]:
    """(service, pid) of a resource, as the reader takes them from its attributes."""
    attributes = _read_back(resource)
    pid = attributes.get(semconv.PROCESS_PID)
    return str(attributes.get(semconv.SERVICE_NAME, "")), semconv.NO_PID if pid is None else pid


def _row(span: ReadableSpan, process: tuple[str, int]) -> tuple:
    """The reader's row of `span` (semconv.SPAN_COLUMNS' values, times in epoch ns)."""
    context = span.get_span_context()
    times = (span.start_time, span.end_time)
    if not (context.trace_id and context.span_id) or not all(
            type(t) is int and 0 <= t <= otlp_json.MAX_TIME_NS for t in times):
        raise _NoPart  # the reader refuses the invalid id and times past int64 ns
    parent = span.parent.span_id if span.parent is not None else 0
    attributes = _read_back(span.attributes or {})
    request_id = attributes.get(semconv.REQUEST_ID)
    return (otlp_json.hex_of(context.trace_id, TRACE), otlp_json.hex_of(context.span_id, SPAN),
            otlp_json.hex_of(parent, SPAN) if parent else "", span.name, *times,
            None if request_id is None else str(request_id), attributes, *process)


def _read_back(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """`attributes` as the reader of their json_attributes gets them: plain values, kvscope's
    keys typed by contract.otlp_json.decode_attribute (OtlpJsonError where the reader skips
    the document for it; a value already of its declared type, as the tracer sets them, is
    the decoded one)."""
    out = {}
    for key, value in attributes.items():
        name, plain = str(key), _plain(value)
        declared = semconv.ATTRIBUTE_TYPES.get(name)
        out[name] = plain if declared is None or declared.holds(plain) else \
            otlp_json.decode_attribute(name, plain)
    return out


def _plain(value: Any) -> Any:
    """The value protobuf's reader gives for json_value(value); _NoPart for what json_value
    writes as another type than the value's own (a str subclass's text, a mapping) or the
    reader refuses (an integer past int64)."""
    kind = type(value)
    if kind is bool or kind is str or kind is bytes:
        return value
    if isinstance(value, float):
        return float(value)
    if isinstance(value, int) and int(value) in otlp_json.INT64_RANGE:
        return int(value)
    if kind is tuple or kind is list:
        return [_plain(v) for v in value]
    raise _NoPart


PART_ERRORS = "OtlpJsonFileExporter.part"  # failsafe's count of parts not written
PART_FIX = ("its span file was written; analysis parses that file instead (check that "
            "RUN/spans/parts is a private directory of this user with room to write)")


def write_part(path: Path, document: bytes, spans: Sequence[ReadableSpan]) -> None:
    """The part of span file `path` (whose bytes are `document`, made of `spans`), in
    its directory's parts/ (made or checked private), unless `part_rows` gives none."""
    rows = part_rows(spans)
    if rows is None:
        return
    part = table.part_of(path)
    files.private_dir(part.parent)
    with files.atomic_writer(part) as sink:
        pq.write_table(pa.Table.from_batches([rows]).replace_schema_metadata(
            {table.META_SOURCE: table.part_source(path, document)}), sink)


class OtlpJsonFileExporter(SpanExporter):
    """Writes `<prefix>-<pid>-<exporter pid>-<n>.json` per export call into `directory`, made
    or checked private (contract.files) before each write: one that fails the rule fails the
    export. `pid` is the process whose spans these are; the exporter's own pid keeps a
    restarted exporter's files from replacing its predecessor's. Its part follows
    (`parts/<same name>.parquet`, contract.spantable.part_of); a part that cannot be written
    is counted (failsafe, PART_ERRORS) and the export still succeeds: the file holds the
    spans, and readers parse it."""

    def __init__(self, directory: str | os.PathLike, prefix: str, pid: int | None = None
                 ) -> None:
        self.directory = Path(directory)
        pid = os.getpid() if pid is None else pid
        self.stem = f"{prefix}-{pid}" if pid == os.getpid() else f"{prefix}-{pid}-{os.getpid()}"
        self._sequence = itertools.count()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        path = self.directory / f"{self.stem}-{next(self._sequence):05d}.json"
        document = span_file(spans).encode()
        files.private_dir(self.directory)
        files.atomic_write(path, document)
        try:
            write_part(path, document, spans)
        except (OSError, ValueError, pa.ArrowException) as e:  # UnsafePath is a ValueError
            failsafe.count(PART_ERRORS, e, PART_FIX)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing is held open between batches."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
