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
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext, SpanKind

from kvscope.contract import files, otlp_json

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


class OtlpJsonFileExporter(SpanExporter):
    """Writes `<prefix>-<pid>-<exporter pid>-<n>.json` per export call into `directory`, made
    or checked private (contract.files) before each write: one that fails the rule fails the
    export. `pid` is the process whose spans these are; the exporter's own pid keeps a
    restarted exporter's files from replacing its predecessor's."""

    def __init__(self, directory: str | os.PathLike, prefix: str, pid: int | None = None
                 ) -> None:
        self.directory = Path(directory)
        pid = os.getpid() if pid is None else pid
        self.stem = f"{prefix}-{pid}" if pid == os.getpid() else f"{prefix}-{pid}-{os.getpid()}"
        self._sequence = itertools.count()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        name = f"{self.stem}-{next(self._sequence):05d}.json"
        files.private_dir(self.directory)
        files.atomic_write(self.directory / name, span_file(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing is held open between batches."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
