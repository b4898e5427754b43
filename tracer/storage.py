# SPDX-License-Identifier: Apache-2.0
"""Storage-read spans, children of kv.load: LMCache's disk backends (stock, raw-block, the fs
connector) and kvscope's own.

Stock `LocalDiskBackend`: `batched_get_blocking` (and `get_blocking` for one key) becomes one
span per batch, and so does `batched_get_non_blocking` (async loading; held in
tracer.async_reads until the request's load). Its `read_file` runs on the "disk-read" pool
threads, which do not inherit our context, so each read finds its batch by chunk key to report
the threads (joined with the probes' block I/O by tid) and bytes. kvscope's parallel backend
reports the same facts through its listener hooks (patched_backend/parallel_disk/hooks.py);
`ParallelReadListener` turns each submit/complete pair into a span whose times are the
backend's own stamps.

LMCache's other disk paths (`on_peer_get`): `RustRawBlockBackend.batched_get_blocking` reads on
the retrieving thread (posix engine) or hands one batch to the Rust extension's io_uring thread
(named `rust-rawblock-*`, whose tid the block probes see); `RemoteBackend.batched_get_blocking`
with the fs connector runs each chunk's O_DIRECT read (`FSConnector._get_with_odirect`, the
connector's only function that touches the file) on the event loop's executor threads, which
report to the batch like the stock backend's readers, by chunk key (the file's name).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from kvscope.tracer import async_reads, extents, runtime, spans
from kvscope.contract import semconv
from kvscope.contract.host import whole_disk
from kvscope.tracer.ledger import fs_connection
from kvscope.tracer.worker import current

STOCK_BACKEND = "lmcache-local-disk"
RAW_BLOCK_BACKEND = "lmcache-raw-block-"  # + its io engine (posix, io_uring)
FS_BACKEND = "lmcache-fs"
RAW_BLOCK_THREADS = "rust-rawblock"  # the extension's I/O threads' name prefix (comm)
_in_batch: ContextVar[bool] = ContextVar("kvscope_read_batch", default=False)
_lock = threading.Lock()
_by_key: dict[Any, "_Batch"] = {}
_inflight = [0]
_rust_threads: set[int] = set()  # the raw-block extension's io_uring threads (_rust_io_threads)


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


def _get_as_batch(wrapped: Any, args: tuple, kwargs: dict, by_text: bool
                  ) -> tuple[list[Any], int, _Batch, Any]:
    """Run a backend's get of `keys` (or `key`) as one batch its reader threads report to, by
    key (and by the key's text: the fs connector's readers know only the file name). Returns
    (keys, start ns, batch, the get's result)."""
    keys = args[0] if args else kwargs.get("keys", kwargs.get("key"))
    keys = list(keys) if isinstance(keys, (list, tuple)) else [keys]
    marker = _in_batch.set(True)
    started = time.monotonic_ns()
    try:
        with _stock_batch([*keys, *(_key_text(k) for k in keys)] if by_text else keys) as batch:
            result = wrapped(*args, **kwargs)
    finally:
        _in_batch.reset(marker)
    return keys, started, batch, result


def on_stock_get(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps LocalDiskBackend.batched_get_blocking(keys) and get_blocking(key)."""
    request = current.get()
    if request is None or _in_batch.get():
        return wrapped(*args, **kwargs)
    _, started, batch, result = _get_as_batch(wrapped, args, kwargs, by_text=False)
    spans.record(runtime.get(), semconv.SPAN_STORAGE_READ, request, started,
                 time.monotonic_ns(), _stock_attributes(batch, instance),
                 parent=spans.current_parent.get())
    return result


def on_stock_get_non_blocking(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps LocalDiskBackend.batched_get_non_blocking(lookup_id, keys): async loading's reads,
    made at lookup, before the request's trace reaches the worker (tracer.async_reads)."""
    lookup_id = str(args[0] if args else kwargs.get("lookup_id"))
    keys = list(args[1] if len(args) > 1 else kwargs.get("keys", []))

    async def traced() -> Any:
        started = time.monotonic_ns()
        with _stock_batch(keys) as batch:
            result = await wrapped(*args, **kwargs)
        async_reads.add(lookup_id, started, time.monotonic_ns(),
                        _stock_attributes(batch, instance))
        return result

    return traced()


def on_peer_get(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps batched_get_blocking(keys) and get_blocking(key) of LMCache's raw-block plugin and
    of its RemoteBackend (the fs connector): one span per batch, its bytes those it loaded."""
    request = current.get()
    label = peer_label(instance)
    if request is None or label is None or _in_batch.get():
        return wrapped(*args, **kwargs)
    keys, started, batch, result = _get_as_batch(wrapped, args, kwargs, by_text=True)
    loaded = [o for o in (result if isinstance(result, list) else [result]) if o is not None]
    if label.startswith(RAW_BLOCK_BACKEND):
        batch.tids |= (_rust_io_threads() if label.endswith("io_uring")
                       else {threading.get_native_id()})
        batch.reads = len(loaded)
    batch.bytes = sum(int(o.get_size()) for o in loaded)
    attributes = _stock_attributes(batch, instance)
    attributes[semconv.READ_CHUNKS] = len(keys)
    attributes[semconv.READ_BACKEND] = label
    attributes[semconv.READ_DEVICE] = device_of(peer_path(instance))
    attributes[semconv.READ_FAILED_CHUNKS] = len(keys) - len(loaded)
    spans.record(runtime.get(), semconv.SPAN_STORAGE_READ, request, started,
                 time.monotonic_ns(), attributes, parent=spans.current_parent.get())
    return result


def on_fs_read(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps FSConnector._get_with_odirect(file_path), on an executor thread: the read reports
    its thread to the batch of its key (the file's name is the key's text)."""
    path = str(args[0] if args else kwargs.get("file_path"))
    key = path.rsplit("/", 1)[-1].removesuffix(".data").replace("-SEP-", "/")
    return _reported_read(key, lambda: wrapped(*args, **kwargs), 0)


def peer_label(instance: Any) -> str | None:
    """The backend label of a raw-block tier (with its io engine) or an fs-connector tier;
    None for any other backend (another remote connector: no disk of ours to read)."""
    if type(instance).__name__ == "RustRawBlockBackend":
        extra = getattr(getattr(instance, "config", None), "extra_config", None) or {}
        return RAW_BLOCK_BACKEND + str(extra.get("rust_raw_block.io_engine") or "posix")
    if fs_connection(instance) is not None:
        return FS_BACKEND
    return None


def peer_path(instance: Any) -> str:
    """Where a peer tier's chunks live: the raw-block device (or image) or the fs base path."""
    device = getattr(instance, "device_path", None)
    if device:
        return str(device)
    paths = getattr(fs_connection(instance), "base_paths", None) or [""]
    return str(paths[0])


def _key_text(key: Any) -> str:
    to_string = getattr(key, "to_string", None)
    return to_string() if callable(to_string) else str(key)


def _rust_io_threads() -> set[int]:
    """This process's threads of the raw-block extension's io_uring worker, by name: found once
    (a scan of /proc/self/task, ~100 threads in a vLLM worker), then remembered (the worker
    lives as long as its device is open)."""
    if _rust_threads:
        return set(_rust_threads)
    found = set()
    for task in os.scandir("/proc/self/task"):
        try:
            with open(f"{task.path}/comm") as comm:
                if comm.read().startswith(RAW_BLOCK_THREADS):
                    found.add(int(task.name))
        except OSError:
            continue  # a thread that ended meanwhile
    _rust_threads.update(found)
    return found


def on_stock_read_file(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps LocalDiskBackend.read_file(key, buffer, path), on the reader thread."""
    key = args[0] if args else kwargs.get("key")
    buffer = args[1] if len(args) > 1 else kwargs.get("buffer")
    return _reported_read(key, lambda: wrapped(*args, **kwargs),
                          len(buffer) if buffer is not None else 0)


def _reported_read(key: Any, read: Callable[[], Any], nbytes: int) -> Any:
    """Run one reader thread's read of `key`, counted in flight, and report its thread, bytes
    and count to the batch that registered the key (if any)."""
    with _lock:
        batch = _by_key.get(key)
        _inflight[0] += 1
    try:
        return read()
    finally:
        with _lock:
            _inflight[0] -= 1
            if batch is not None:
                batch.tids.add(threading.get_native_id())
                batch.bytes += nbytes
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
            owner: tuple[spans.RequestTrace, int] | str = (request, spans.current_parent.get())
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
        attributes.update(chunk_locations(event.chunks))
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
        attributes = _parallel_attributes(event, event.bytes, len(event.keys),
                                          event.reader_tids, event.failed_keys, read_ahead=True)
        attributes.update(chunk_locations(event.chunks))
        spans.record(runtime.get(), semconv.SPAN_STORAGE_READ, request, event.submit_ns,
                     event.end_ns, attributes)


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


def chunk_locations(chunks: tuple[Any, ...]) -> dict[str, Any]:
    """Span attributes saying, per chunk read (hooks.ChunkReadRecord), its key, read window
    and disk extents: the identity analysis joins block reads by (docs/run-directory.md)."""
    starts, ends, owners = [], [], []
    for index, chunk in enumerate(chunks):
        sectors = extents.file_sectors(chunk.path, chunk.identity, chunk.offset, chunk.length)
        for start, end in sectors or ():
            owners.append(index)
            starts.append(start)
            ends.append(end)
    return {
        semconv.READ_CHUNK_KEY: [c.key for c in chunks],
        semconv.READ_CHUNK_SUBMIT_NS: [c.submit_ns for c in chunks],
        semconv.READ_CHUNK_READY_NS: [c.ready_ns for c in chunks],
        semconv.READ_EXTENT_CHUNK: owners,
        semconv.READ_EXTENT_START: starts,
        semconv.READ_EXTENT_END: ends,
    }


@functools.lru_cache(maxsize=64)
def device_of(path: str) -> str:
    """contract.host.whole_disk, remembered: every read batch names its disk."""
    return whole_disk(path)
