# SPDX-License-Identifier: Apache-2.0
"""The workload client's root span per request, and the `traceparent` that carries it.

The span starts at the client's `arrival_ns` and ends at `finish_ns` (the same monotonic stamps
requests.parquet records), so the root of every trace covers exactly what the user waited for.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from kvscope.contract import semconv
from kvscope.tracer import spans
from kvscope.tracer.pipeline import Pipeline
from kvscope.tracer.version import SCOPE, __version__


class ClientTracer:
    """Starts and ends `kvscope.client.request` spans through the SDK in the workload's own
    process (not a serving one: its spans are few and its thread is not vLLM's)."""

    def __init__(self, pipe: Pipeline, offset_ns: int) -> None:
        self.tracer = pipe.provider.get_tracer(SCOPE, __version__)
        self.offset_ns = offset_ns

    def epoch(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns

    def start(self, record: Any) -> tuple[trace.Span, dict[str, str]]:
        """A root span for `record` (a RequestRecord with arrival_ns set) and its headers."""
        span = self.tracer.start_span(
            semconv.SPAN_CLIENT_REQUEST, kind=trace.SpanKind.CLIENT,
            start_time=self.epoch(record.arrival_ns),
            attributes={semconv.REQUEST_ID: record.request_id, semconv.PHASE: record.phase,
                        semconv.PROMPT_INDEX: record.prompt_index,
                        semconv.CONCURRENCY: record.concurrency})
        record.trace_id = format(span.get_span_context().trace_id, "032x")
        return span, spans.headers_from_context(trace.set_span_in_context(span))

    def end(self, span: trace.Span, record: Any) -> None:
        """Close the span at finish_ns with what the request saw."""
        if span.is_recording():
            span.set_attributes({
                semconv.GEN_AI_PROMPT_TOKENS: record.prompt_tokens,
                semconv.CACHED_TOKENS: record.cached_tokens,
                semconv.GEN_AI_COMPLETION_TOKENS: record.output_tokens,
            })
            if record.first_token_ns > 0:
                span.set_attribute(semconv.GEN_AI_TTFT, record.ttft_s)
            if record.status != "ok":
                span.set_attribute(semconv.ERROR_TYPE, record.error.split(":", 1)[0] or "error")
                span.set_status(trace.Status(trace.StatusCode.ERROR, record.error[:200]))
        span.end(end_time=self.epoch(record.finish_ns))
