# SPDX-License-Identifier: Apache-2.0
"""Storage-read spans, children of kv.load: LMCache's stock disk backend and kvscope's own.

Stock `LocalDiskBackend`: `batched_get_blocking` (and `get_blocking` for one key) becomes one
span per batch, and so does `batched_get_non_blocking` (async loading; held in
tracer.async_reads until the request's load). Its `read_file` runs on the "disk-read" pool
threads, which do not inherit our context, so each read finds its batch by chunk key to report
the threads (joined with the probes' block I/O by tid) and bytes. kvscope's parallel backend
reports the same facts through its listener hooks (patched_backend/parallel_disk/hooks.py);
`ParallelReadListener` turns each submit/complete pair into a span whose times are the
backend's own stamps.
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator

from opentelemetry import context as otel_context

from kvscope.tracer import async_reads, runtime, spans
from kvscope.contract import semconv
from kvscope.contract.host import whole_disk
from kvscope.tracer.worker import current

STOCK_BACKEND = "lmcache-local-disk"
_in_batch: ContextVar[bool] = ContextVar("kvscope_read_batch", default=False)
_lock = threading.Lock()
_by_key: dict[Any, "_Batch"] = {}
_inflight = [0]


@dataclass
class _Batch:
    keys: list[Any]
    inflight_at_submit: int = 0
    tids: set[int] = field(default_factory=set)
    bytes: int = 0
    reads: int = 0


@contextmanager
def _stock_batch(keys: list[Any]) -> Iterator[_Batch]:
    """Lets the stock backend's read_file calls for `keys` report to one batch meanwhile."""
    batch = _Batch(keys)
    with _lock:
        batch.inflight_at_submit = _inflight[0]
        _by_key.update({k: batch for k in keys})
    try:
        yield batch
    finally:
        with _lock:
            for k in keys:
                _by_key.pop(k, None)


def _stock_attributes(batch: _Batch, instance: Any) -> dict[str, Any]:
    return {
        semconv.READ_BYTES: batch.bytes, semconv.READ_CHUNKS: len(batch.keys),
        semconv.READ_SUBREADS: batch.reads, semconv.READ_BACKEND: STOCK_BACKEND,
        semconv.READ_DEVICE: device_of(getattr(instance, "path", "") or ""),
        semconv.READ_INFLIGHT_AT_SUBMIT: batch.inflight_at_submit,
        semconv.READER_TIDS: sorted(batch.tids),
    }


def on_stock_get(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps LocalDiskBackend.batched_get_blocking(keys) and get_blocking(key)."""
    request = current.get()
    if request is None or _in_batch.get():
        return wrapped(*args, **kwargs)
    keys = args[0] if args else kwargs.get("keys", kwargs.get("key"))
    keys = list(keys) if isinstance(keys, (list, tuple)) else [keys]
    marker = _in_batch.set(True)
    started = time.monotonic_ns()
    try:
        with _stock_batch(keys) as batch:
            result = wrapped(*args, **kwargs)
    finally:
        _in_batch.reset(marker)
    spans.record(runtime.get(), semconv.SPAN_STORAGE_READ, request, started,
                 time.monotonic_ns(), _stock_attributes(batch, instance),
                 parent=otel_context.get_current())
    return result


def on_stock_get_non_blocking(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps LocalDiskBackend.batched_get_non_blocking(lookup_id, keys): async loading's reads,
    made at lookup, before the request's trace reaches the worker (tracer.async_reads)."""
    lookup_id = args[0] if args else kwargs.get("lookup_id")
    keys = list(args[1] if len(args) > 1 else kwargs.get("keys", []))

    async def traced() -> Any:
        started = time.monotonic_ns()
        with _stock_batch(keys) as batch:
            result = await wrapped(*args, **kwargs)
        async_reads.add(lookup_id, started, time.monotonic_ns(),
                        _stock_attributes(batch, instance))
        return result

    return traced()


def on_stock_read_file(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps LocalDiskBackend.read_file(key, buffer, path), on the reader thread."""
    key = args[0] if args else kwargs.get("key")
    with _lock:
        batch = _by_key.get(key)
        _inflight[0] += 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        with _lock:
            _inflight[0] -= 1
            if batch is not None:
                buffer = args[1] if len(args) > 1 else kwargs.get("buffer")
                batch.tids.add(threading.get_native_id())
                batch.bytes += len(buffer) if buffer is not None else 0
                batch.reads += 1


class ParallelReadListener:
    """Listener for patched_backend.parallel_disk.hooks: one span per batch of reads.

    A batch read ahead at lookup (`prefetch_on_lookup`) is submitted outside any request; it
    becomes a span of the request whose load claimed it, over the read's own times (from the
    lookup, so usually before kv.load starts: a sibling of kv.load, not its child). Its submit
    is never attributed, even when it runs on a retrieving thread (a backlog read started when
    another request's claim freed budget): each read belongs to exactly one request, the one
    that claims it. A batch of LMCache's async loading carries the lookup id and waits in
    tracer.async_reads for its load.
    """

    def __init__(self) -> None:
        # batch id -> (request, parent context) for sync reads, or the async lookup id
        self._pending: dict[int, tuple[spans.RequestTrace, Any] | str] = {}
        self._lock = threading.Lock()

    def on_read_submit(self, event: Any) -> None:
        if event.path_kind == "prefetch":
            return  # reported by the claiming get (on_read_claim), whoever's thread started it
        request = current.get()  # the submit runs on the retrieving thread, inside kv.load
        if request is not None:
            owner: tuple[spans.RequestTrace, Any] | str = (request, otel_context.get_current())
        elif event.path_kind == "async" and event.request_id:
            owner = event.request_id
        else:
            return
        with self._lock:
            self._pending[event.batch_id] = owner

    def on_read_complete(self, event: Any) -> None:
        submit = event.submit
        with self._lock:
            owner = self._pending.pop(submit.batch_id, None)
        if owner is None:
            return
        attributes = _parallel_attributes(
            submit, event.ok_bytes, submit.chunk_count, event.reader_tids, event.failed_keys,
            read_ahead=False)
        attributes[semconv.READ_INFLIGHT_AT_SUBMIT] = submit.inflight_at_submit
        if isinstance(owner, str):
            async_reads.add(owner, submit.submit_ns, event.end_ns, attributes)
            return
        request, parent = owner
        spans.record(runtime.get(), semconv.SPAN_STORAGE_READ, request, submit.submit_ns,
                     event.end_ns, attributes, parent=parent)

    def on_read_claim(self, event: Any) -> None:
        request = current.get()  # the claim runs on the retrieving thread, inside kv.load
        if request is None:
            return
        spans.record(runtime.get(), semconv.SPAN_STORAGE_READ, request, event.submit_ns,
                     event.end_ns, _parallel_attributes(
                         event, event.bytes, len(event.keys), event.reader_tids,
                         event.failed_keys, read_ahead=True))


def _parallel_attributes(event: Any, ok_bytes: int, chunks: int, reader_tids: tuple[int, ...],
                         failed_keys: tuple[str, ...], read_ahead: bool) -> dict[str, Any]:
    """Attributes of a kvscope-backend read span; `event` has backend_path, mode, sub_reads."""
    return {
        semconv.READ_BYTES: ok_bytes, semconv.READ_CHUNKS: chunks,
        semconv.READ_SUBREADS: event.sub_reads, semconv.READ_BACKEND: f"kvscope-{event.mode}",
        semconv.READ_DEVICE: device_of(event.backend_path),
        semconv.READER_TIDS: list(reader_tids), semconv.READ_FAILED_CHUNKS: len(failed_keys),
        semconv.READ_AHEAD: read_ahead,
    }


@functools.lru_cache(maxsize=64)
def device_of(path: str) -> str:
    """contract.host.whole_disk, remembered: every read batch names its disk."""
    return whole_disk(path)
