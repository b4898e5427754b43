# SPDX-License-Identifier: Apache-2.0
"""Storage reads of LMCache's asynchronous loading, held until their request's load.

With `enable_async_loading` the worker reads a request's chunks when the scheduler looks it up,
keyed by LMCache's lookup id (vLLM's request id), before any step of that request reaches the
worker: no trace context is known yet. The finished reads wait here and become spans of the
request when its kv.load runs (tracer/worker.py), with their own times. Bounded: the reads of
lookups that never load (aborted requests) are dropped oldest first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from kvscope.tracer import runtime, spans
from kvscope.contract import semconv

LIMIT = 4096  # lookup ids held at most

_lock = threading.Lock()
_held: "OrderedDict[str, list[tuple[int, int, dict[str, Any]]]]" = OrderedDict()


def add(lookup_id: str, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None:
    """A finished read made for `lookup_id`."""
    with _lock:
        _held.setdefault(lookup_id, []).append((start_ns, end_ns, attributes))
        _held.move_to_end(lookup_id)
        while len(_held) > LIMIT:
            _held.popitem(last=False)


def flush(request: spans.RequestTrace) -> None:
    """Record the held reads of `request` as its storage-read spans (siblings of kv.load)."""
    with _lock:
        reads = _held.pop(request.vllm_request_id, [])
    for start_ns, end_ns, attributes in reads:
        spans.record(runtime.get(), semconv.SPAN_STORAGE_READ, request, start_ns, end_ns,
                     attributes)


def held() -> int:
    """Lookup ids with reads waiting for their load (diagnostics, tests)."""
    with _lock:
        return len(_held)
