# SPDX-License-Identifier: Apache-2.0
"""API-server side: keep the client's trace headers on the request vLLM hands its engine.

vLLM drops incoming `traceparent` headers unless `--otlp-traces-endpoint` is set (and then it
also exports its own spans there). With tracing on we want the context inside the engine
either way, so `AsyncLLM.add_request` parks the headers in a context variable instead of
passing them on, and `InputProcessor.assign_request_id` (called inside add_request, same task)
puts them on the EngineCoreRequest. With vLLM's own tracing on, nothing here changes anything.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Mapping

_parked: ContextVar[Mapping[str, str] | None] = ContextVar("kvscope_trace_headers", default=None)


async def keep_trace_headers(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps AsyncLLM.add_request."""
    headers = kwargs.get("trace_headers")
    config = getattr(instance, "observability_config", None)
    if not headers or getattr(config, "otlp_traces_endpoint", None) is not None:
        return await wrapped(*args, **kwargs)
    token = _parked.set(dict(headers))
    try:
        return await wrapped(*args, **{**kwargs, "trace_headers": None})
    finally:
        _parked.reset(token)


def restore_trace_headers(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps InputProcessor.assign_request_id(request)."""
    headers = _parked.get()
    request = args[0] if args else kwargs.get("request")
    if headers and request is not None and getattr(request, "trace_headers", None) is None:
        request.trace_headers = headers
    return wrapped(*args, **kwargs)
