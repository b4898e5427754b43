# SPDX-License-Identifier: Apache-2.0
"""API-server side: a server request span for every request, and its context for the engine.

Every request the API server hands its engine gets a `kvscope.server.request` span (SpanKind
SERVER), from `AsyncLLM.add_request` to the output that finishes it, with the first token as
an event. A caller's W3C `traceparent` makes it a child; without one it is a new root, so
traffic from curl, SDKs and gateways is traced too. Sampling is the standard
`OTEL_TRACES_SAMPLER`: an unsampled request is left exactly as vLLM would handle it.

The span's context replaces the request's trace headers, so the engine core's and worker's
spans (and vLLM's own `llm_request` span when `--otlp-traces-endpoint` is set) join the
same trace. vLLM drops trace headers when its own tracing is off, so `add_request` parks them
in a context variable and `InputProcessor.assign_request_id` (called inside add_request, same
task) puts them on the EngineCoreRequest, where the internal request id also becomes known.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context

from kvscope.tracer import runtime, spans
from kvscope.contract import semconv

MAX_OPEN = 8192  # open server spans beyond this are dropped unexported, oldest first


@dataclass
class _Open:
    """A request between add_request and the output that finishes it."""

    span: trace.Span
    headers: dict[str, str]
    arrived_ns: int
    first_token_ns: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)


_parked: ContextVar[_Open | None] = ContextVar("kvscope_server_request", default=None)
_open: dict[str, _Open] = {}  # internal (engine) request id -> its open server span


async def on_add_request(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps AsyncLLM.add_request: the server span starts; its context rides with the request."""
    arrived = time.monotonic_ns()
    rt = runtime.get()
    if rt is None:
        return await wrapped(*args, **kwargs)
    incoming = kwargs.get("trace_headers")
    span = rt.tracer.start_span(semconv.SPAN_SERVER_REQUEST, kind=trace.SpanKind.SERVER,
                                context=spans.context_from_headers(incoming) or Context(),
                                start_time=rt.epoch(arrived))
    if not span.is_recording():
        return await wrapped(*args, **kwargs)
    request = _Open(span, spans.headers_from_context(trace.set_span_in_context(span)), arrived)
    vllm_traces = getattr(getattr(instance, "observability_config", None),
                          "otlp_traces_endpoint", None) is not None
    # vLLM keeps the headers only with its own tracing on; otherwise assign_request_id adds them.
    kwargs = {**kwargs, "trace_headers": request.headers if vllm_traces else None}
    token = _parked.set(request)
    try:
        return await wrapped(*args, **kwargs)
    except BaseException as error:
        spans.finish(rt, span, time.monotonic_ns(), error)
        raise
    finally:
        _parked.reset(token)


def on_assign_request_id(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps InputProcessor.assign_request_id(request): the engine request gets our context."""
    result = wrapped(*args, **kwargs)
    request = _parked.get()
    engine_request = args[0] if args else kwargs.get("request")
    if request is None or engine_request is None:
        return result
    if getattr(engine_request, "trace_headers", None) is None:
        engine_request.trace_headers = request.headers
    rid = engine_request.request_id
    prompt = getattr(engine_request, "prompt_token_ids", None)
    request.span.set_attributes({
        semconv.GEN_AI_REQUEST_ID: getattr(engine_request, "external_req_id", None) or rid,
        semconv.REQUEST_ID: spans.client_request_id(rid),
        semconv.VLLM_REQUEST_ID: rid,
        **({semconv.GEN_AI_PROMPT_TOKENS: len(prompt)} if prompt is not None else {}),
    })
    while len(_open) >= MAX_OPEN:  # never finished (n > 1 fans out under other ids): unexported
        _open.pop(next(iter(_open)))
    _open[rid] = request
    return result


def on_process_outputs(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps OutputProcessor.process_outputs: first token marked, finished requests' spans end."""
    if not _open:
        return wrapped(*args, **kwargs)
    outputs = args[0] if args else kwargs.get("engine_core_outputs", ())
    states = getattr(instance, "request_states", {})
    mine = [(o, _open[o.request_id], states.get(o.request_id)) for o in outputs
            if o.request_id in _open]
    result = wrapped(*args, **kwargs)
    if not mine:
        return result
    now = time.monotonic_ns()
    rt = runtime.get()
    if rt is None:  # no runtime, no open spans: only a failed build gets here
        return result
    for output, request, state in mine:
        if output.new_token_ids and not request.first_token_ns:
            request.first_token_ns = now
            request.span.add_event(semconv.EVENT_FIRST_TOKEN, timestamp=rt.epoch(now))
        if output.finish_reason is not None:
            _open.pop(output.request_id, None)
            _finish(rt, request, state, now)
    return result


def on_abort_requests(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps OutputProcessor.abort_requests: spans of requests vLLM forgot end as aborted."""
    result = wrapped(*args, **kwargs)
    states = getattr(instance, "request_states", {})
    gone = [rid for rid in _open if rid not in states]
    if gone:
        rt, now = runtime.get(), time.monotonic_ns()
        for rid in gone:
            request = _open.pop(rid)
            request.span.set_status(trace.Status(trace.StatusCode.ERROR, "aborted"))
            request.span.set_attribute(semconv.ERROR_TYPE, "aborted")
            _finish(rt, request, None, now)
    return result


def _finish(rt: Any, request: _Open, state: Any, now_ns: int) -> None:
    """End the server span at `now_ns` with the latencies vLLM and we both measured."""
    attributes: dict[str, Any] = {}
    if request.first_token_ns:
        attributes[semconv.GEN_AI_TTFT] = (request.first_token_ns - request.arrived_ns) / 1e9
    stats = getattr(state, "stats", None)
    if stats is not None:
        attributes[semconv.GEN_AI_COMPLETION_TOKENS] = int(stats.num_generation_tokens)
        if stats.scheduled_ts and stats.queued_ts:
            attributes[semconv.GEN_AI_TIME_IN_QUEUE] = stats.scheduled_ts - stats.queued_ts
    request.span.set_attributes(attributes)
    request.span.end(end_time=rt.epoch(now_ns) if rt is not None else None)


def forget_all() -> None:
    """Drop every open server span unexported (uninstrument)."""
    _open.clear()
