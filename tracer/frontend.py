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

from kvscope.contract import semconv, span_record
from kvscope.tracer import ids, runtime, spans

MAX_OPEN = 8192  # open server spans beyond this are dropped unrecorded, oldest first


@dataclass
class _Open:
    """A request between add_request and the output that finishes it."""

    trace_id: int
    span_id: int
    parent_id: int  # the caller's span, 0 for a root
    headers: dict[str, str]
    arrived_ns: int
    extra: dict[str, Any] = field(default_factory=dict)  # tracestate, events, status
    parent_sampled: bool | None = None  # what the caller's traceparent said, if it sent one
    first_token_ns: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)


_parked: ContextVar[_Open | None] = ContextVar("kvscope_server_request", default=None)
_open: dict[str, _Open] = {}  # internal (engine) request id -> its open server span


def _opened(rt: runtime.Runtime, incoming: Any, arrived: int) -> _Open | None:
    """The request's server span, or None when the sampler says it is not traced (it then
    costs nothing further in any process)."""
    parent = spans.remote_parent(incoming) or trace.INVALID_SPAN_CONTEXT
    context = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent.is_valid \
        else None
    trace_id = parent.trace_id if parent.is_valid else ids.trace_id()
    decision = rt.sampler.should_sample(context, trace_id, semconv.SPAN_SERVER_REQUEST,
                                        trace.SpanKind.SERVER)
    if not decision.decision.is_sampled():
        return None
    span_id = ids.span_id()
    state = parent.trace_state if parent.is_valid else decision.trace_state
    headers = {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"}
    request = _Open(trace_id, span_id, parent.span_id if parent.is_valid else 0, headers,
                    arrived)
    if state:
        request.extra["trace_state"] = headers["tracestate"] = state.to_header()
    if parent.is_valid:
        request.parent_sampled = parent.trace_flags.sampled
    return request


async def on_add_request(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps AsyncLLM.add_request: the server span starts; its context rides with the request."""
    arrived = time.monotonic_ns()
    rt = runtime.get()
    if rt is None:
        return await wrapped(*args, **kwargs)
    request = _opened(rt, kwargs.get("trace_headers"), arrived)
    if request is None:
        return await wrapped(*args, **kwargs)
    vllm_traces = getattr(getattr(instance, "observability_config", None),
                          "otlp_traces_endpoint", None) is not None
    # vLLM keeps the headers only with its own tracing on; otherwise assign_request_id adds them.
    kwargs = {**kwargs, "trace_headers": request.headers if vllm_traces else None}
    token = _parked.set(request)
    try:
        return await wrapped(*args, **kwargs)
    except BaseException as error:
        request.attributes[semconv.ERROR_TYPE] = type(error).__qualname__
        _record(rt, request, time.monotonic_ns(), str(error)[:200])
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
    request.attributes.update({
        semconv.GEN_AI_REQUEST_ID: getattr(engine_request, "external_req_id", None) or rid,
        semconv.REQUEST_ID: spans.client_request_id(rid),
        semconv.VLLM_REQUEST_ID: rid,
        **({semconv.GEN_AI_PROMPT_TOKENS: len(prompt)} if prompt is not None else {}),
    })
    while len(_open) >= MAX_OPEN:  # never finished (n > 1 fans out under other ids): unrecorded
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
            if rt.tail:
                _first_token_mark(rt, request, now)
        if output.finish_reason is not None:
            _open.pop(output.request_id, None)
            _finish(rt, request, state, now)
    return result


def _first_token_mark(rt: runtime.Runtime, request: _Open, now_ns: int) -> None:
    """Tells the exporter's tail sampler that this request's first token is out."""
    rt.recorder.put(semconv.SPAN_SERVER_REQUEST, span_record.MARK_FIRST_TOKEN, 0,
                    request.trace_id, request.span_id, request.parent_id, request.arrived_ns,
                    now_ns, (None, None, None if request.parent_sampled is None else
                             {"parent_sampled": request.parent_sampled}, None))


def on_abort_requests(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps OutputProcessor.abort_requests: spans of requests vLLM forgot end as aborted."""
    result = wrapped(*args, **kwargs)
    states = getattr(instance, "request_states", {})
    gone = [rid for rid in _open if rid not in states]
    if gone:
        rt, now = runtime.get(), time.monotonic_ns()
        for rid in gone:
            request = _open.pop(rid)
            request.attributes[semconv.ERROR_TYPE] = "aborted"
            _finish(rt, request, None, now, "aborted")
    return result


def _finish(rt: runtime.Runtime | None, request: _Open, state: Any, now_ns: int,
            error: str | None = None) -> None:
    """End the server span at `now_ns` with the latencies vLLM and we both measured."""
    if rt is None:
        return
    attributes = request.attributes
    if request.first_token_ns:
        attributes[semconv.GEN_AI_TTFT] = (request.first_token_ns - request.arrived_ns) / 1e9
        request.extra["events"] = [(semconv.EVENT_FIRST_TOKEN, request.first_token_ns)]
    stats = getattr(state, "stats", None)
    if stats is not None:
        attributes[semconv.GEN_AI_COMPLETION_TOKENS] = int(stats.num_generation_tokens)
        if stats.scheduled_ts and stats.queued_ts:
            attributes[semconv.GEN_AI_TIME_IN_QUEUE] = stats.scheduled_ts - stats.queued_ts
    _record(rt, request, now_ns, error)


def _record(rt: runtime.Runtime, request: _Open, end_ns: int, error: str | None) -> None:
    flags = span_record.PARENT_REMOTE if request.parent_id else 0
    if error is not None:
        flags |= span_record.ERROR
        request.extra["status"] = error
    rt.recorder.put(semconv.SPAN_SERVER_REQUEST, span_record.SERVER, flags, request.trace_id,
                    request.span_id, request.parent_id, request.arrived_ns,
                    max(end_ns, request.arrived_ns),
                    (None, None, request.attributes, request.extra or None))


def forget_all() -> None:
    """Drop every open server span unrecorded (uninstrument)."""
    _open.clear()
