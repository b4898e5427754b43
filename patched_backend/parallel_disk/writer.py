# SPDX-License-Identifier: Apache-2.0
"""Chunk writes off the request path: admission (capacity, LRU eviction) then a writer thread.

A failed write (ENOSPC, EIO, metadata that does not fit the header, any error) only skips
that store: its reservation is returned, the error is counted and logged, serving and the
chunks already on disk are untouched. Each queued write holds its memory object (LMCache
pool memory) until written, so the queue is bounded in bytes: a store that does not fit is
dropped (``stores_dropped``; the chunk is simply not on disk, a miss later).
"""

import errno
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any, Callable, Hashable, Optional

from kvscope.patched_backend.parallel_disk import hooks
from kvscope.patched_backend.parallel_disk.chunkfile import (
    ChunkHeader, block_hashes, file_size_for, hash_block_for, write_chunk,
)
from kvscope.patched_backend.parallel_disk.index import ChunkIndex, Entry
from kvscope.patched_backend.parallel_disk.stats import BackendStats

logger = logging.getLogger(__name__)


class ChunkWriter:
    """Admits chunk stores and writes them in ``threads`` background threads."""

    def __init__(self, directory: str, index: ChunkIndex, stats: BackendStats, threads: int,
                 queue_bytes: int) -> None:
        self._dir = directory
        self._index = index
        self._stats = stats
        self.queue_bytes = queue_bytes
        self._queued = 0  # payload bytes of writes queued or running
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvscope-write")
        self._pending: set[Hashable] = set()
        self._futures: set[Future] = set()
        self._lock = threading.Lock()

    def pending(self, key: Hashable) -> bool:
        """True while a write of ``key`` is queued or running."""
        with self._lock:
            return key in self._pending

    def submit(self, key: Hashable, header: ChunkHeader, mem_obj: Any,
               on_complete: Optional[Callable[[Hashable], None]] = None) -> bool:
        """Queue one store; False when skipped (present, in flight, queue full, or no space)."""
        with self._lock:
            if key in self._pending or self._index.get(key) is not None:
                return False
            dropped = bool(self._queued) and self._queued + header.payload_len > self.queue_bytes
            if not dropped:
                self._pending.add(key)
                self._queued += header.payload_len
        if dropped:
            self._stats.add(stores_dropped=1)
            logger.warning("kvscope disk: write queue full (%d MiB queued); store of %s dropped",
                           self.queue_bytes >> 20, header.key)
            self._not_queued(header, "queue_full",
                             f"write queue full ({self.queue_bytes} bytes queued)")
            return False
        size = file_size_for(header.payload_len)
        victims = self._index.reserve(size)
        if victims is None:
            self._dequeue(key, header.payload_len)
            self._stats.add(stores_skipped=1)
            logger.warning("kvscope disk: no evictable space for %d bytes in %s (capacity %d); "
                           "store of %s skipped", size, self._dir, self._index.capacity, header.key)
            self._not_queued(header, "no_space",
                             f"no evictable space within capacity {self._index.capacity} bytes")
            return False
        mem_obj.ref_count_up()
        try:
            future = self._pool.submit(self._write, key, header, mem_obj, size, victims,
                                       on_complete)
        except RuntimeError:  # closed: nothing will write it
            mem_obj.ref_count_down()
            self._index.release(size)
            self._dequeue(key, header.payload_len)
            self._evict(victims)
            return False
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget)
        return True

    def _not_queued(self, header: ChunkHeader, reason: str, error: str) -> None:
        if hooks.has_listeners():
            now = time.monotonic_ns()
            hooks.emit("on_store", hooks.StoreEvent(self._dir, header.key, 0, now, now, False,
                                                    error, -1, reason))

    def queued_bytes(self) -> int:
        """Payload bytes of writes queued or running (gauge)."""
        with self._lock:
            return self._queued

    def _dequeue(self, key: Hashable, payload_len: int) -> None:
        with self._lock:
            self._pending.discard(key)
            self._queued -= payload_len

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait for the writes queued so far; False if ``timeout`` expired first."""
        with self._lock:
            futures = list(self._futures)
        return not wait(futures, timeout=timeout).not_done

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)
        if future.exception() is not None:
            logger.error("kvscope disk: chunk write crashed", exc_info=future.exception())

    def close(self) -> None:
        """Finish queued writes, then stop."""
        self._pool.shutdown(wait=True)

    def _write(self, key: Hashable, header: ChunkHeader, mem_obj: Any, size: int,
               victims: list[Entry], on_complete: Optional[Callable[[Hashable], None]]) -> None:
        start = time.monotonic_ns()
        error = reason = ""
        try:
            self._evict(victims)
            payload = mem_obj.byte_array
            block = hash_block_for(header.payload_len)
            header = replace(header, hash_block=block, hashes=block_hashes(payload, block))
            path, st = write_chunk(self._dir, header, payload)
        except Exception as exc:  # any failure: the reservation must come back
            error = _describe(exc)
            reason = error.split(":", 1)[0] if isinstance(exc, OSError) else "error"
            self._index.release(size)
            self._stats.add(store_failures=1)
            logger.warning("kvscope disk: store of %s skipped: %s", header.key, error)
        else:
            entry = Entry(key, path, header, st.st_size, (st.st_dev, st.st_ino, st.st_size))
            self._index.publish(entry, size)
            self._stats.add(stores=1, store_bytes=st.st_size)
        finally:
            mem_obj.ref_count_down()
            self._dequeue(key, header.payload_len)
        hooks.emit("on_store", hooks.StoreEvent(
            self._dir, header.key, size, start, time.monotonic_ns(), not error, error,
            threading.get_native_id(), reason))
        if not error and on_complete is not None:
            try:
                on_complete(key)
            except Exception:
                logger.warning("on_complete_callback failed for %s", header.key, exc_info=True)

    def _evict(self, victims: list[Entry]) -> None:
        for entry in victims:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
            self._stats.add(evictions=1, evicted_bytes=entry.file_size)
            hooks.emit("on_evict", hooks.EvictEvent(self._dir, entry.header.key, entry.file_size,
                                                    time.monotonic_ns(), self._index.capacity))



def _describe(exc: Exception) -> str:
    """``ENOSPC: No space left on device`` for OS errors, ``ValueError: ...`` otherwise."""
    if isinstance(exc, OSError):
        return f"{errno.errorcode.get(exc.errno or 0, 'OSError')}: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"
