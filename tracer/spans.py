# SPDX-License-Identifier: Apache-2.0
"""Small helpers every wrapper uses: W3C headers <-> context, request ids, finished spans."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvscope.contract import semconv
from kvscope.tracer.runtime import Runtime

_PROPAGATOR = TraceContextTextMapPropagator()
# vLLM's engine id: "cmpl-<X-Request-Id>-<n>-<8 hex>" (completions) or "chatcmpl-<id>-<8 hex>".
_VLLM_ID = re.compile(r"^(?:cmpl-(?P<c>.+)-\d+|chatcmpl-(?P<h>.+)|(?P<o>.+))-[0-9a-f]{8}$")


def client_request_id(vllm_request_id: str) -> str:
    """The client's X-Request-Id inside vLLM's engine request id (the id itself if no match)."""
    match = _VLLM_ID.match(vllm_request_id)
    if match is None:
        return vllm_request_id
    return match.group("c") or match.group("h") or match.group("o")


def context_from_headers(headers: Mapping[str, str] | None) -> Context | None:
    """The remote parent carried by W3C `traceparent`/`tracestate`, or None."""
    if not headers or "traceparent" not in headers:
        return None
    context = _PROPAGATOR.extract(dict(headers))
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def sampled_context_from_headers(headers: Mapping[str, str] | None) -> Context | None:
    """The remote parent if it is sampled: an unsampled request costs no further work."""
    context = context_from_headers(headers)
    if context is None:
        return None
    return context if trace.get_current_span(context).get_span_context().trace_flags.sampled \
        else None


def headers_from_context(context: Context | None = None) -> dict[str, str]:
    """`traceparent` (and `tracestate`) for `context` (default: the current one)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


@dataclass(frozen=True)
class RequestTrace:
    """What a process needs to put a span into one request's trace."""

    parent: Context
    request_id: str  # the client's id
    vllm_request_id: str

    @classmethod
    def from_headers(cls, headers: Mapping[str, str] | None,
                     vllm_request_id: str) -> "RequestTrace | None":
        parent = sampled_context_from_headers(headers)
        if parent is None:
            return None
        return cls(parent, client_request_id(vllm_request_id), vllm_request_id)

    def attributes(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        base = {semconv.REQUEST_ID: self.request_id,
                semconv.VLLM_REQUEST_ID: self.vllm_request_id}
        return {**base, **(extra or {})}


def record(runtime: Runtime | None, name: str, request: RequestTrace, start_ns: int, end_ns: int,
           attributes: Mapping[str, Any] | None = None,
           parent: Context | None = None) -> None:
    """A finished span of `request` over monotonic [start_ns, end_ns], a child of the span
    current in `parent` (else of the request's own parent); none in a process whose runtime
    could not be built (runtime.get() said why, once)."""
    if runtime is None:
        return
    context = trace.get_current_span(parent).get_span_context() if parent else None
    if context is None or not context.is_valid:
        context = trace.get_current_span(request.parent).get_span_context()
    runtime.finished(name, context, start_ns, end_ns, request.attributes(attributes))


def start(runtime: Runtime, name: str, request: RequestTrace, start_ns: int,
          attributes: Mapping[str, Any] | None = None) -> trace.Span:
    """An open span of `request` started at monotonic `start_ns`; end it with `finish`."""
    return runtime.tracer.start_span(name, context=request.parent,
                                     start_time=runtime.epoch(start_ns),
                                     attributes=request.attributes(attributes))


def finish(runtime: Runtime, span: trace.Span, end_ns: int, error: BaseException | None = None
           ) -> None:
    if error is not None and span.is_recording():
        span.set_attribute(semconv.ERROR_TYPE, type(error).__qualname__)
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)[:200]))
    span.end(end_time=runtime.epoch(end_ns))
