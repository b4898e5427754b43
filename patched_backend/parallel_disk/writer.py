# SPDX-License-Identifier: Apache-2.0
"""Chunk writes off the request path: admission (capacity, LRU eviction) then a writer thread.

A failed write (ENOSPC, EIO, ...) only skips that store: its reservation is returned, the error
is counted and logged, serving and the chunks already on disk are untouched.
"""

# Standard
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any, Callable, Hashable, Optional
import errno
import logging
import os
import threading
import time

# First Party
from patched_backend.parallel_disk import hooks
from patched_backend.parallel_disk.chunkfile import (
    ChunkHeader, block_crcs, crc_block_for, file_size_for, write_chunk,
)
from patched_backend.parallel_disk.index import ChunkIndex, Entry
from patched_backend.parallel_disk.stats import BackendStats

logger = logging.getLogger(__name__)


class ChunkWriter:
    """Admits chunk stores and writes them in ``threads`` background threads."""

    def __init__(self, directory: str, index: ChunkIndex, stats: BackendStats, threads: int) -> None:
        self._dir = directory
        self._index = index
        self._stats = stats
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
        """Queue one store; False when skipped (present, in flight, or no space)."""
        with self._lock:
            if key in self._pending or self._index.get(key) is not None:
                return False
            self._pending.add(key)
        size = file_size_for(header.payload_len)
        victims = self._index.reserve(size)
        if victims is None:
            with self._lock:
                self._pending.discard(key)
            self._stats.add(stores_skipped=1)
            logger.warning("kvscope disk: no evictable space for %d bytes in %s (capacity %d); "
                           "store of %s skipped", size, self._dir, self._index.capacity, header.key)
            return False
        mem_obj.ref_count_up()
        future = self._pool.submit(self._write, key, header, mem_obj, size, victims, on_complete)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget)
        return True

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
        self._evict(victims)
        start = time.monotonic_ns()
        error = ""
        try:
            payload = mem_obj.byte_array
            block = crc_block_for(header.payload_len)
            header = replace(header, crc_block=block, crcs=block_crcs(payload, block))
            path, st = write_chunk(self._dir, header, payload)
        except OSError as exc:
            error = f"{errno.errorcode.get(exc.errno or 0, 'OSError')}: {exc.strerror or exc}"
            self._index.release(size)
            self._stats.add(store_failures=1)
            logger.warning("kvscope disk: store of %s skipped: %s", header.key, error)
        else:
            entry = Entry(key, path, header, st.st_size, (st.st_dev, st.st_ino, st.st_size))
            self._index.publish(entry, size)
            self._stats.add(stores=1, store_bytes=st.st_size)
        finally:
            mem_obj.ref_count_down()
            with self._lock:
                self._pending.discard(key)
        hooks.emit("on_store", hooks.StoreEvent(
            self._dir, header.key, size, start, time.monotonic_ns(), not error, error,
            threading.get_native_id()))
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
            hooks.emit("on_evict", hooks.EvictEvent(self._dir, entry.header.key, entry.file_size))

