# SPDX-License-Identifier: Apache-2.0
"""Listener hooks: how a tracer sees the backend's reads and writes (no OpenTelemetry here).

A listener is any object with some of these methods; each gets one frozen event::

    on_read_submit(ReadSubmitEvent)     a batch of chunk reads was queued
    on_read_complete(ReadCompleteEvent) every chunk of that batch finished (or failed)
    on_read_claim(ReadClaimEvent)       a get took chunks read ahead at lookup (prefetch.py)
    on_store(StoreEvent)                a chunk write finished (ok or not)
    on_corrupt(CorruptEvent)            a chunk file was refused (never served)
    on_evict(EvictEvent)                a chunk was evicted for capacity

Callbacks run in the backend's threads (caller, reader, writer): keep them short. Exceptions
are logged and swallowed so a broken listener never breaks serving. ``request_context(id)``
tags the synchronous reads made inside it with a request id (the async prefetch path already
carries LMCache's lookup id).
"""

import logging
import threading
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, Optional

logger = logging.getLogger(__name__)

_listeners: list[Any] = []
_lock = threading.Lock()
_backends: "weakref.WeakSet[Any]" = weakref.WeakSet()
_request_id: ContextVar[Optional[str]] = ContextVar("kvscope_disk_request_id", default=None)


@dataclass(frozen=True)
class ReadSubmitEvent:
    """A batch of chunk reads handed to the I/O engine."""

    batch_id: int
    backend_path: str
    mode: str  # "parallel" | "serial"
    path_kind: str  # "sync" (retrieve) | "async" (prefetch)
    request_id: Optional[str]  # lookup id (async) or request_context() value (sync)
    keys: tuple[str, ...]
    chunk_count: int
    bytes: int  # payload bytes requested
    sub_reads: int
    inflight_at_submit: int  # sub-reads queued or running in the engine just before
    submit_ns: int  # time.monotonic_ns()


@dataclass(frozen=True)
class ChunkReadRecord:
    """One chunk file read: which bytes of which file, and the window its block reads lie in.

    This is the read's identity for joining block-layer I/O to it (kvscope.analysis.blockjoin
    maps ``offset``/``length`` to disk sectors): whatever engine or thread issues the reads,
    every block read of these bytes is submitted at or after ``submit_ns`` and before
    ``ready_ns``.
    """

    key: str
    path: str
    identity: Optional[tuple[int, int, int]]  # st_dev, st_ino, st_size of the file read
    offset: int  # first byte of the file read (the payload, after the header)
    length: int  # bytes read from ``offset`` (the payload rounded up to 4 KiB)
    submit_ns: int  # when its reads were queued (time.monotonic_ns())
    ready_ns: int  # when its last read completed, -1 if it has not (timed out, still running)
    failed: bool  # the chunk was refused or not read: a miss


@dataclass(frozen=True)
class ReadCompleteEvent:
    """Every chunk of a batch is done; ``failed_keys`` were refused (misses)."""

    submit: ReadSubmitEvent
    end_ns: int
    ok_chunks: int
    ok_bytes: int
    failed_keys: tuple[str, ...]
    reader_tids: tuple[int, ...]  # native thread ids that ran the reads (join with eBPF)
    first_chunk_ready_ns: int  # when the first chunk was complete and verified, -1 if none
    chunks: tuple[ChunkReadRecord, ...]  # every chunk of the batch, in key order


@dataclass(frozen=True)
class ReadClaimEvent:
    """A synchronous get took chunks read ahead at lookup: one event per read batch it took from.

    Sent from the retrieving thread once those chunks are done, so a tracer can give the read
    to the request that waited for it (the batch's own submit carries no request id).
    """

    backend_path: str
    mode: str
    request_id: Optional[str]  # request_context() value of the get
    keys: tuple[str, ...]  # the chunks taken from this batch
    bytes: int  # payload bytes of the taken chunks that were served (verified)
    sub_reads: int
    submit_ns: int  # when the read ahead was submitted (the lookup)
    claim_ns: int  # when the get asked for the chunks
    end_ns: int  # when the last taken chunk was complete (before or after claim_ns)
    reader_tids: tuple[int, ...]  # native thread ids that ran the batch's reads
    failed_keys: tuple[str, ...]
    chunks: tuple[ChunkReadRecord, ...]  # the chunks taken from this batch, in ``keys`` order


@dataclass(frozen=True)
class StoreEvent:
    """A chunk write off the request path."""

    backend_path: str
    key: str
    bytes: int
    start_ns: int
    end_ns: int
    ok: bool
    error: str  # "" when ok, else e.g. "ENOSPC: No space left on device"
    writer_tid: int
    # why it was not stored: "" when ok, "queue_full" / "no_space" (not queued: no write was
    # tried, writer_tid -1), else the errno name ("ENOSPC", "EIO") or "error"
    reason: str = ""


@dataclass(frozen=True)
class CorruptEvent:
    """A chunk file that was not served (miss + recompute)."""

    backend_path: str
    key: str  # "" when the file's header could not be parsed
    file: str
    reason: str  # foreign | corrupt_header | truncated | checksum | missing | replaced | io_error
    detail: str
    at_startup: bool


@dataclass(frozen=True)
class EvictEvent:
    """A chunk removed to make room (LRU)."""

    backend_path: str
    key: str
    bytes: int
    at_ns: int = -1  # time.monotonic_ns() of the eviction
    capacity_bytes: int = -1  # the capacity (kvscope.capacity) that made it go


def add_listener(listener: Any) -> None:
    """Register ``listener`` (idempotent)."""
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)


def remove_listener(listener: Any) -> None:
    """Unregister ``listener``; a no-op when it was not registered."""
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


@contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Tag synchronous reads issued by this thread/task inside the block with ``request_id``."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


def current_request_id() -> Optional[str]:
    """The id set by the innermost ``request_context``, or None."""
    return _request_id.get()


def register_backend(backend: Any) -> None:
    """Called by each ParallelDiskBackend so a tracer can poll ``stats()`` without a handle."""
    _backends.add(backend)


def unregister_backend(backend: Any) -> None:
    """A closed backend is no longer polled (else its counters linger in every later total of
    this process until the garbage collector gets to it)."""
    _backends.discard(backend)


def live_backends() -> list[Any]:
    """Backends alive in this process (each has ``stats() -> dict``)."""
    return list(_backends)


def has_listeners() -> bool:
    """True when at least one listener is registered (lets callers skip building events)."""
    return bool(_listeners)


def emit(method: str, event: Any) -> None:
    """Call ``method(event)`` on every listener that has it; log and swallow their errors."""
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        callback = getattr(listener, method, None)
        if callback is None:
            continue
        try:
            callback(event)
        except Exception:
            logger.warning("kvscope disk listener %r failed in %s", listener, method, exc_info=True)
