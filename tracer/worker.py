# SPDX-License-Identifier: Apache-2.0
"""Worker side: KV load (with transfer children), prefill forward and KV store spans.

Everything here hangs off the KV connector interface vLLM publishes, which both model runners
call in the same order each step (V1: `KVConnectorModelRunnerMixin._get_kv_connector_output`;
V2: `vllm/v1/worker/gpu/kv_connector.py`, `ActiveKVConnector.pre_forward` / `post_forward`):

    bind_connector_metadata -> [start_load_kv, if the step has sync loads] -> model forward
    -> [finish_forward (V2)] -> [start_load_kv, if not] -> wait_for_save -> ... -> clear

The scheduler's payload arrives with the step's connector metadata at `bind_connector_metadata`;
from it each request of the step gets its trace context back, and the step's `sync_loads` flag
says which `start_load_kv` precedes the forward. The forward (the prefill span of each request
prefilling in the step) runs from the end of the last connector call before it to the start of
the first one after it. LMCache's per-request `retrieve`/`store` carry `req_id=` (vLLM's id),
which picks the request. While a retrieve runs, its kv.load span is the current context, so
storage reads and transfers made inside it (tracer.storage, `on_to_device`) become its children
(spans.current_parent).
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable

from kvscope.tracer import async_reads, ledger, runtime, spans
from kvscope.contract import semconv
from kvscope.tracer.scheduler import PAYLOAD_ATTR


@dataclass
class _StepRequest:
    trace: spans.RequestTrace
    prefill_tokens: int


@dataclass
class _Step:
    """The traced requests of the step being run, and where its forward starts and ends."""

    requests: dict[str, _StepRequest] = field(default_factory=dict)
    sync_loads: bool = False
    forward_start_ns: int = 0
    forward_end_ns: int = 0


_step = _Step()
current: ContextVar[spans.RequestTrace | None] = ContextVar("kvscope_kv_load", default=None)


def on_bind(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps the connector's bind_connector_metadata(metadata): this step's requests."""
    global _step
    metadata = args[0] if args else kwargs.get("connector_metadata")
    payload = getattr(metadata, PAYLOAD_ATTR, None) or {}
    step = _Step(sync_loads=bool(payload.get("sync_loads")))
    for rid, item in payload.get("requests", {}).items():
        trace_ = spans.RequestTrace.from_headers(item.get("h"), rid)
        if trace_ is not None:
            step.requests[rid] = _StepRequest(trace_, int(item.get("p", 0)))
    _step = step
    result = wrapped(*args, **kwargs)
    if step.requests and not step.sync_loads:
        step.forward_start_ns = time.monotonic_ns()
    return result


def on_start_load_kv(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps start_load_kv: before the forward with sync loads (its end starts the forward),
    after it otherwise (its start ends the forward)."""
    step = _step
    if not step.requests:
        return wrapped(*args, **kwargs)
    if step.sync_loads and not step.forward_start_ns:
        result = wrapped(*args, **kwargs)
        step.forward_start_ns = time.monotonic_ns()
        return result
    _forward_ended(step)
    return wrapped(*args, **kwargs)


def on_forward_done(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps finish_forward (V2) and wait_for_save: the forward is over at the first of them."""
    _forward_ended(_step)
    return wrapped(*args, **kwargs)


def _forward_ended(step: _Step) -> None:
    """Once per step: a prefill span for each request that computed prompt tokens in it."""
    if not step.forward_start_ns or step.forward_end_ns:
        return
    step.forward_end_ns = time.monotonic_ns()
    rt = runtime.get()
    for request in step.requests.values():
        if request.prefill_tokens > 0:
            spans.record(rt, semconv.SPAN_PREFILL, request.trace, step.forward_start_ns,
                         step.forward_end_ns, {semconv.PREFILL_TOKENS: request.prefill_tokens})
    _write_ledger(rt, step)


def _write_ledger(rt: runtime.Runtime | None, step: _Step) -> None:
    """The chunk ledger of each request whose lookup waits (its loads, if any, are done)."""
    for rid, request in step.requests.items():
        record = ledger.LEDGER.take(rid)
        if record is not None:
            spans.record(rt, semconv.SPAN_KV_LEDGER, request.trace, record.start_ns,
                         record.end_ns, ledger.attributes(record, ledger.LEDGER.dropped))


def _traced_call(name: str,
                 on_done: Callable[[Any, spans.OpenSpan], None] | None = None):
    """A wrapper for LMCache engine calls taking req_id=: one span of `name` around them."""

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        step = _step.requests.get(kwargs.get("req_id", ""))
        rt = runtime.get()
        if step is None or rt is None:
            return wrapped(*args, **kwargs)
        span = spans.start(name, step.trace, time.monotonic_ns())
        parent = spans.current_parent.set(span.span_id)
        marker = current.set(step.trace)
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as e:
            spans.finish(rt, span, time.monotonic_ns(), e)
            raise
        finally:
            current.reset(marker)
            spans.current_parent.reset(parent)
            async_reads.flush(step.trace)  # reads made for this request's lookup, if any
        if on_done is not None:
            on_done(result, span)
        spans.finish(rt, span, time.monotonic_ns())
        return result

    return wrapper


def _loaded_tokens(mask: Any, span: spans.OpenSpan) -> None:
    span.attributes[semconv.HIT_TOKENS] = int(mask.sum()) if hasattr(mask, "sum") else -1
    request = span.request
    served = ledger.served_tokens(mask)
    if served is not None and request.vllm_request_id:
        ledger.LEDGER.loaded(request.vllm_request_id, served)


on_retrieve = _traced_call(semconv.SPAN_KV_LOAD, _loaded_tokens)
on_store = _traced_call(semconv.SPAN_KV_STORE)


def on_to_device(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps the LMCache GPU connector's batched_to_gpu: the copy into the paged KV cache.

    kvscope's pipelined connector waits for each chunk's reads between its copies and lists
    the copies it made (`copies`): each is a transfer span of its own, so the waits stay
    storage-read time."""
    request = current.get()
    if request is None:
        return wrapped(*args, **kwargs)
    started = time.monotonic_ns()
    result = wrapped(*args, **kwargs)
    ended = time.monotonic_ns()
    objs = args[0] if args else kwargs.get("memory_objs") or ()
    copies = getattr(instance, "copies", None)
    kind = transfer_kind(instance, kwargs)
    pieces = ([(s, e, n, 1) for s, e, n in copies] if copies
              else [(started, ended, sum(int(o.get_size()) for o in objs), len(objs))])
    for begin, end, nbytes, chunks in pieces:
        spans.record(runtime.get(), semconv.SPAN_KV_TRANSFER, request, begin, end, {
            semconv.TRANSFER_BYTES: nbytes, semconv.TRANSFER_KIND: kind,
            semconv.READ_CHUNKS: chunks,
        }, parent=spans.current_parent.get())
    return result


def transfer_kind(connector: Any, kwargs: dict) -> str:
    """`h2d` into a CUDA KV cache, `cpu_copy` into a CPU one (vLLM-CPU), else `<device>_copy`."""
    caches = getattr(connector, "kvcaches", None) or kwargs.get("kvcaches") or ()
    first = next(iter(caches.values() if isinstance(caches, dict) else caches), None)
    device = getattr(getattr(first, "device", None), "type", "unknown")
    return {"cuda": "h2d", "cpu": "cpu_copy"}.get(device, f"{device}_copy")


def forget_all() -> None:
    global _step
    _step = _Step()
    ledger.LEDGER.forget_all()
