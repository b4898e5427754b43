# SPDX-License-Identifier: Apache-2.0
"""A span exporter that writes each batch as one OTLP JSON document into a directory.

One file per batch (not one per process) because vLLM's worker processes can be killed at
shutdown: whatever was exported before is already safe on disk. Files are written to a
temporary name and renamed, so a reader never sees half a document. Ids are hex, as OTLP JSON
requires (protobuf's own JSON mapping would write base64, which Jaeger's UI rejects).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
from pathlib import Path
from typing import Any, Sequence

from google.protobuf import json_format
from google.protobuf.message import Message
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvscope.contract import files

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def otlp_json_document(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """The ExportTraceServiceRequest for `spans` in the OTLP JSON mapping (hex ids)."""
    return otlp_json(encode_spans(spans))


def otlp_json(request: Message) -> dict[str, Any]:
    """An ExportTraceServiceRequest message as an OTLP JSON document (hex ids, not base64)."""
    document = json_format.MessageToDict(request)
    for resource_spans in document.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _hex_ids(span)
                for link in span.get("links", ()):
                    _hex_ids(link)
    return document


def _hex_ids(item: dict[str, Any]) -> None:
    for key in _ID_FIELDS:
        if item.get(key):
            item[key] = base64.b64decode(item[key]).hex()


class OtlpJsonFileExporter(SpanExporter):
    """Writes `<prefix>-<pid>-<n>.json` per export call into `directory`, made or checked
    private (contract.files) before each write: one that fails the rule fails the export."""

    def __init__(self, directory: str | os.PathLike, prefix: str) -> None:
        self.directory = Path(directory)
        self.prefix = prefix
        self._sequence = itertools.count()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        name = f"{self.prefix}-{os.getpid()}-{next(self._sequence):05d}.json"
        files.private_dir(self.directory)
        files.atomic_write(self.directory / name,
                           json.dumps(otlp_json_document(spans), separators=(",", ":")))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing is held open between batches."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
