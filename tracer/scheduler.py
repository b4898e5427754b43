# SPDX-License-Identifier: Apache-2.0
"""Engine-core side: queue, KV lookup and first-token spans, and the context for the worker.

Each request's W3C context comes in on `Request.trace_headers` (see tracer.frontend). The
queue span runs from the scheduler receiving the request to the start of the `schedule()` call
that first admits it (vLLM's own `scheduled_ts`). After each `schedule()`, the headers of every
request still in prefill ride to the worker on the step's KV-connector metadata (attribute
PAYLOAD_ATTR), so worker spans join the same trace: the context crosses processes in-band.
The payload also says whether the step has synchronous KV loads, which is what tells the worker
whether `start_load_kv` runs before the forward or after it (both model runners).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvscope.tracer import runtime, spans
from kvscope.contract import semconv

logger = logging.getLogger(__name__)
PAYLOAD_ATTR = "kvscope_trace"  # {"requests": {vllm id: {"h": headers, "p": prefill tokens}},
#                                  "sync_loads": the step's has_sync_kv_loads}
MAX_LIVE = 8192  # requests aborted before their first token are forgotten beyond this


@dataclass
class _Live:
    trace: spans.RequestTrace
    headers: dict[str, str]
    arrived_ns: int
    scheduled: bool = False


_live: dict[str, _Live] = {}


def on_add_request(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps Scheduler.add_request(request): the request arrived in the engine."""
    arrived = time.monotonic_ns()
    result = wrapped(*args, **kwargs)
    request = args[0] if args else kwargs["request"]
    headers = getattr(request, "trace_headers", None)
    trace = spans.RequestTrace.from_headers(headers, request.request_id)
    if trace is not None:
        while len(_live) >= MAX_LIVE:
            _live.pop(next(iter(_live)))
        _live[request.request_id] = _Live(trace, dict(headers or {}), arrived)
    return result


def on_schedule(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps Scheduler.schedule(): queue spans end here; worker payload attached."""
    started = time.monotonic_ns()
    output = wrapped(*args, **kwargs)
    if not _live:
        return output
    rt = runtime.get()
    for new in output.scheduled_new_reqs:
        live = _live.get(new.req_id)
        if live is not None and not live.scheduled:
            live.scheduled = True
            spans.record(rt, semconv.SPAN_QUEUE, live.trace, live.arrived_ns, started)
    _attach_payload(instance, output)
    return output


def _attach_payload(scheduler: Any, output: Any) -> None:
    metadata = getattr(output, "kv_connector_metadata", None)
    if metadata is None:
        return
    requests = {}
    for rid, scheduled in output.num_scheduled_tokens.items():
        live, request = _live.get(rid), scheduler.requests.get(rid)
        if live is None or request is None:
            continue
        before = request.num_computed_tokens - scheduled
        prefill = max(0, min(request.num_prompt_tokens, before + scheduled) - before)
        requests[rid] = {"h": live.headers, "p": prefill}
    payload = {"requests": requests,
               "sync_loads": bool(getattr(output, "has_sync_kv_loads", False))}
    try:
        setattr(metadata, PAYLOAD_ATTR, payload)
    except AttributeError:
        logger.warning("kvscope tracer: %s takes no extra attribute; worker spans will be "
                       "missing", type(metadata).__name__)


def on_lookup(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps the connector's get_num_new_matched_tokens(request, num_computed_tokens)."""
    started = time.monotonic_ns()
    result = wrapped(*args, **kwargs)
    ended = time.monotonic_ns()
    request = args[0] if args else kwargs["request"]
    live = _live.get(request.request_id)
    if live is not None:
        hits = result[0] if isinstance(result, tuple) else result
        computed = args[1] if len(args) > 1 else kwargs.get("num_computed_tokens", -1)
        spans.record(runtime.get(), semconv.SPAN_KV_LOOKUP, live.trace, started, ended,
                     {semconv.HIT_TOKENS: -1 if hits is None else int(hits),
                      semconv.VLLM_CACHED_TOKENS: int(computed)})
    return result


def on_update_from_output(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps Scheduler.update_from_output(scheduler_output, ...): first-token markers."""
    scheduler_output = args[0] if args else kwargs["scheduler_output"]
    waiting = [(rid, instance.requests.get(rid)) for rid in scheduler_output.num_scheduled_tokens
               if rid in _live]
    result = wrapped(*args, **kwargs)
    now = time.monotonic_ns()
    for rid, request in waiting:
        if request is None or (request.num_output_tokens == 0 and not request.is_finished()):
            continue
        live = _live.pop(rid)
        spans.record(runtime.get(), semconv.SPAN_FIRST_TOKEN, live.trace, now, now,
                     {semconv.GEN_AI_PROMPT_TOKENS: request.num_prompt_tokens})
    return result


def forget_all() -> None:
    """Drop every pending request (uninstrument)."""
    _live.clear()
