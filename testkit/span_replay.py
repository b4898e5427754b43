"""Span files made again through the tracer's file exporter, with their parts.

A recorded run holds OTLP JSON span files only (runs recorded before parts existed, or copied
without them); tests and bench/span_table_load.py need the same spans as the exporter writes
them today: each file and its part (tracer.fileexport). The spans are made again as SDK spans
from the files (contract.otlp_json reads them), with what the span table holds (ids, parent,
name, kind, times, resource, attributes); copy k > 0 of a run gets other trace ids and
request ids, so that copies are other requests, not repeated spans.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from kvscope.contract import files, otlp_json, rundir, semconv
from kvscope.tracer.fileexport import OtlpJsonFileExporter

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_IS_REMOTE = 0x200  # OTLP's SpanFlags


def sdk_spans(request: otlp_json.Request, copy: int = 0) -> list[ReadableSpan]:
    """The finished SDK spans of `request`; copy `copy` (> 0: trace ids xor `copy` in their
    high half, request ids suffixed `-<copy>`)."""
    out = []
    for resource_spans in request.resource_spans:
        resource = Resource(otlp_json.attributes(resource_spans.resource.attributes))
        for scope_spans in resource_spans.scope_spans:
            scope = InstrumentationScope(scope_spans.scope.name,
                                         scope_spans.scope.version or None)
            out += [_span(span, resource, scope, copy) for span in scope_spans.spans]
    return out


def _span(span: Any, resource: Resource, scope: InstrumentationScope, copy: int
          ) -> ReadableSpan:
    trace_id = int.from_bytes(span.trace_id, "big") ^ (copy << 64)
    attributes = otlp_json.attributes(span.attributes)
    if copy and semconv.REQUEST_ID in attributes:
        attributes[semconv.REQUEST_ID] = f"{attributes[semconv.REQUEST_ID]}-{copy}"
    parent = None
    if span.parent_span_id:
        parent = SpanContext(trace_id, int.from_bytes(span.parent_span_id, "big"),
                             bool(span.flags & _IS_REMOTE), _SAMPLED)
    return ReadableSpan(
        name=span.name, context=SpanContext(trace_id, int.from_bytes(span.span_id, "big"),
                                            False, _SAMPLED),
        parent=parent, resource=resource, attributes=attributes,
        kind=SpanKind(max(span.kind - 1, 0)),  # OTLP numbers kinds from UNSPECIFIED = 0
        start_time=span.start_time_unix_nano, end_time=span.end_time_unix_nano,
        instrumentation_scope=scope)


def export_again(source: Path, target: Path, copies: int = 1,
                 batch_spans: int | None = None) -> int:
    """Every span file of spans directory `source`, `copies` times, written into `target`
    through OtlpJsonFileExporter, a file and its part per batch: a file's copy each, or
    batches of `batch_spans` spans of its copies (the SDK's batch processor exports up to 512
    at once). Files are named by their source file, so that they sort as those do. Returns
    the number of spans written."""
    written = 0
    for path in sorted(Path(source).glob("*.json")):
        request = otlp_json.loads(files.read_bytes(path, rundir.SPAN_FILE_MAX_BYTES))
        exporter = OtlpJsonFileExporter(target, path.stem)
        copied = [sdk_spans(request, copy) for copy in range(copies)]
        if batch_spans is not None:
            every = [span for spans in copied for span in spans]
            copied = [every[at:at + batch_spans] for at in range(0, len(every), batch_spans)]
        for spans in copied:
            exporter.export(spans)
            written += len(spans)
    return written
