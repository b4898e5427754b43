# SPDX-License-Identifier: Apache-2.0
"""Small helpers every wrapper uses: W3C headers <-> context, request ids, span records."""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvscope.contract import semconv, span_record
from kvscope.tracer import ids
from kvscope.tracer.runtime import Runtime

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
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


def remote_parent(headers: Mapping[str, str] | None) -> trace.SpanContext | None:
    """The caller's span in W3C `traceparent`/`tracestate`, or None. A plain version-00
    `traceparent` without `tracestate` (what kvscope's API server sends on, and most callers)
    is read here directly, in a tenth of the propagator's time; anything else by the
    propagator."""
    value = headers.get("traceparent") if headers else None
    if not value:
        return None
    plain = _TRACEPARENT.match(value) if "tracestate" not in headers else None  # type: ignore[operator]
    if plain is None:
        context = context_from_headers(headers)
        return None if context is None else trace.get_current_span(context).get_span_context()
    trace_id, span_id = int(plain.group(1), 16), int(plain.group(2), 16)
    if not trace_id or not span_id:
        return None
    return trace.SpanContext(trace_id, span_id, True, trace.TraceFlags(int(plain.group(3), 16)))


def headers_from_context(context: Context | None = None) -> dict[str, str]:
    """`traceparent` (and `tracestate`) for `context` (default: the current one)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


@dataclass(frozen=True)
class RequestTrace:
    """What a process needs to put a span into one request's trace: its ids as integers, so
    that a span costs no context lookups."""

    trace_id: int
    parent_id: int  # the span this process's spans of the request hang from
    request_id: str  # the client's id
    vllm_request_id: str
    extra: dict[str, str] | None = None  # {"trace_state": the caller's tracestate}, if any

    @classmethod
    def from_headers(cls, headers: Mapping[str, str] | None,
                     vllm_request_id: str) -> "RequestTrace | None":
        """The trace of a request whose W3C headers say it is sampled, else None (every
        process of a request reads its headers once)."""
        context = remote_parent(headers)
        if context is None or not context.trace_flags.sampled:
            return None
        state = context.trace_state.to_header() if context.trace_state else ""
        return cls(context.trace_id, context.span_id, client_request_id(vllm_request_id),
                   vllm_request_id, {"trace_state": state} if state else None)


current_parent: ContextVar[int] = ContextVar("kvscope_parent_span", default=0)


def record(runtime: Runtime | None, name: str, request: RequestTrace, start_ns: int, end_ns: int,
           attributes: Mapping[str, Any] | None = None, parent: int = 0) -> None:
    """A finished span of `request` over monotonic [start_ns, end_ns], a child of the span
    `parent` of this process (else of the request's own parent, from another process); none in
    a process whose runtime could not be built (runtime.get() said why, once)."""
    if runtime is None:
        return
    runtime.recorder.put(name, span_record.INTERNAL,
                         0 if parent else span_record.PARENT_REMOTE, request.trace_id,
                         ids.span_id(), parent or request.parent_id, start_ns,
                         end_ns if end_ns > start_ns else start_ns,
                         (request.request_id, request.vllm_request_id, attributes, request.extra))


@dataclass
class OpenSpan:
    """A span of `request` still running: its id is known (children name it as parent)."""

    name: str
    request: RequestTrace
    start_ns: int
    span_id: int = field(default_factory=ids.span_id)
    attributes: dict[str, Any] = field(default_factory=dict)


def start(name: str, request: RequestTrace, start_ns: int) -> OpenSpan:
    return OpenSpan(name, request, start_ns)


def finish(runtime: Runtime, span: OpenSpan, end_ns: int, error: BaseException | None = None
           ) -> None:
    flags, extra = span_record.PARENT_REMOTE, span.request.extra
    if error is not None:
        span.attributes[semconv.ERROR_TYPE] = type(error).__qualname__
        flags |= span_record.ERROR
        extra = {**(extra or {}), "status": str(error)[:200]}
    request = span.request
    runtime.recorder.put(span.name, span_record.INTERNAL, flags, request.trace_id, span.span_id,
                         request.parent_id, span.start_ns, max(end_ns, span.start_ns),
                         (request.request_id, request.vllm_request_id, span.attributes, extra))
