# SPDX-License-Identifier: Apache-2.0
"""The read engine: many O_DIRECT sub-reads in flight, completion marks each chunk ready.

Why threads + ``os.preadv``: the GIL is released during the syscall, so ``queue_depth`` reader
threads keep that many reads in flight at the device, which is what a deep NVMe queue needs.
All sub-reads of a batch (and of concurrent batches) go into one FIFO queue at once; there is
no lock held across a read, so concurrent requests never wait on each other's I/O, only on the
device. A chunk is ready (verified, copied if staged) as soon as its last sub-read lands, while
later chunks are still being read.

With ``queue_depth`` 1 (the backend's serial mode) the one reader takes the FIFO in order: one
``read_unit`` read in flight, each waited for before the next, the chunks one after another.

Every chunk ends, whatever happens: a reader that hits an unexpected exception fails that chunk
and keeps serving; reads submitted after ``close()`` fail at once (``closed``); waiting takes a
timeout (the caller turns what is unfinished into misses, reason ``timeout``).
"""

import errno
import logging
import os
import queue
import threading
import time
from typing import Callable, Optional

from kvscope.patched_backend.parallel_disk.chunkfile import HEADER_SIZE, hash64, padded

logger = logging.getLogger(__name__)

Identity = tuple[int, int, int]  # st_dev, st_ino, st_size


class ChunkRead:
    """One chunk file read into ``dest`` (aligned, ``padded(payload_len)`` bytes long).

    ``hashes`` (XXH3-64, one per ``hash_block`` of payload; None: no verification) are
    checked block by block by the reader thread that completes each block. ``copy_to``, when
    set, receives the payload after verification (staging-buffer case).
    """

    def __init__(self, key: str, path: str, payload_len: int, dest: memoryview,
                 hashes: Optional[tuple[int, ...]], hash_block: int,
                 identity: Optional[Identity], copy_to: Optional[memoryview] = None) -> None:
        self.key, self.path, self.payload_len = key, path, payload_len
        self.dest, self.identity, self.copy_to = dest, identity, copy_to
        self.hashes, self.hash_block = hashes, hash_block
        self._verified = [False] * (len(hashes) if hashes else 0)
        self.error: Optional[tuple[str, str]] = None
        self.ready_ns = -1
        self.fd = -1
        self.batch: Optional["ReadBatch"] = None  # set by the batch it is read in
        self._remaining = 0
        self._lock = threading.Lock()

    def fail(self, reason: str, detail: str) -> None:
        """Record the first failure; the chunk will be a miss."""
        with self._lock:
            if self.error is None:
                self.error = (reason, detail)

    @property
    def done(self) -> bool:
        """True once no reader will touch ``dest`` again."""
        return self.ready_ns >= 0

    def file_range(self) -> tuple[int, int]:
        """(offset, length) of the file bytes the sub-reads cover: the padded payload. Listeners
        map it to disk sectors to tell this chunk's block reads from any other (hooks)."""
        return HEADER_SIZE, padded(self.payload_len)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until this chunk is done (read and verified, or failed); False on timeout."""
        if self.batch is None:
            raise RuntimeError(f"{self.path}: waited for before it was put in a ReadBatch")
        return self.batch.wait_chunk(self, timeout)

    def verify(self, start: int, end: int) -> None:
        """Check the hash of every unverified block lying inside payload bytes [start, end)."""
        if not self.hashes or self.error is not None:
            return
        block = self.hash_block
        for index in range(-(-start // block), len(self.hashes)):
            lo, hi = index * block, min((index + 1) * block, self.payload_len)
            if hi > end:
                break
            if self._verified[index]:
                continue
            if hash64(self.dest[lo:hi]) != self.hashes[index]:
                self.fail("checksum", f"{self.path}: XXH3 mismatch in payload bytes {lo}-{hi}")
                return
            self._verified[index] = True

    def _sub_done(self) -> bool:
        with self._lock:
            self._remaining -= 1
            return self._remaining == 0


class ReadBatch:
    """Chunks read together; ``wait()`` or ``add_done_callback`` for the end of all of them.

    Two conditions on one lock, not an Event per chunk: one wakes whoever waits for single
    chunks (the pipelined transfer), the other only whoever waits for the whole batch, so a
    blocking get is woken once per batch, not once per chunk, and no chunk builds its own
    Event (a Condition, a lock, bound methods: a few microseconds and GC-tracked objects each).
    """

    def __init__(self, chunks: list[ChunkRead]) -> None:
        self.chunks = chunks
        self.submit_ns = time.monotonic_ns()
        self.end_ns = -1
        self.first_ready_ns = -1
        self.sub_reads = 0
        self.tids: set[int] = set()
        self._remaining = len(chunks)
        self._callbacks: list[Callable[["ReadBatch"], object]] = []
        self._lock = threading.Lock()
        self._chunk_cv = threading.Condition(self._lock)
        self._end_cv = threading.Condition(self._lock)
        for chunk in chunks:
            chunk.batch = self
        if not chunks:
            self.end_ns = self.submit_ns

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until every chunk is done or ``timeout`` seconds passed; True when done."""
        with self._lock:
            return self._end_cv.wait_for(lambda: self.end_ns >= 0, timeout)

    def wait_chunk(self, chunk: ChunkRead, timeout: Optional[float] = None) -> bool:
        """Block until ``chunk`` (one of this batch's) is done; False on timeout."""
        with self._lock:
            return self._chunk_cv.wait_for(lambda: chunk.ready_ns >= 0, timeout)

    @property
    def finished(self) -> bool:
        """True once every chunk is done."""
        return self.end_ns >= 0

    def add_done_callback(self, fn: Callable[["ReadBatch"], object]) -> None:
        """Call ``fn(batch)`` when done (right away if it already is), in the finishing thread."""
        with self._lock:
            if self.end_ns < 0:
                self._callbacks.append(fn)
                return
        fn(self)

    def _chunk_done(self, chunk: ChunkRead) -> None:
        now = time.monotonic_ns()
        with self._lock:
            chunk.ready_ns = now
            self._chunk_cv.notify_all()
            if chunk.error is None and self.first_ready_ns < 0:
                self.first_ready_ns = now
            self._remaining -= 1
            if self._remaining:
                return
            self.end_ns = now
            self._end_cv.notify_all()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                logger.warning("read batch callback failed", exc_info=True)


class IOEngine:
    """``queue_depth`` reader threads serving one FIFO of sub-reads, bounded in bytes."""

    def __init__(self, queue_depth: int, read_unit: int, max_inflight_bytes: int,
                 read_delay_ms: float = 0.0, odirect: bool = True) -> None:
        self.read_unit = read_unit
        self.odirect = odirect
        self._delay_s = read_delay_ms / 1000.0
        self._max_bytes = max_inflight_bytes
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._inflight_bytes = 0
        self._pending = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._worker, name=f"kvscope-read-{i}", daemon=True)
            for i in range(queue_depth)
        ]
        for thread in self._threads:
            thread.start()

    def cpu_s(self) -> float:
        """CPU time (user + system) the reader threads have spent so far: what reading costs,
        apart from whatever else the process runs. Valid until ``close()``."""
        return sum(time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
                   for thread in self._threads if thread.ident is not None)

    def pending(self) -> int:
        """Sub-reads queued or running now."""
        with self._cond:
            return self._pending

    def sub_reads_for(self, payload_len: int) -> int:
        """Sub-reads one chunk of ``payload_len`` bytes is split into."""
        total = padded(payload_len)
        return -(-total // self.read_unit)

    def submit(self, batch: ReadBatch) -> int:
        """Open every chunk and queue all their sub-reads; returns sub-reads in flight before.

        After ``close()`` every chunk fails at once (``closed``): nothing is left waiting.
        """
        with self._cond:
            before = self._pending
        for chunk in batch.chunks:
            pieces = self._open_and_plan(chunk)
            with self._cond:  # checked and queued under the lock close() takes: no race
                if pieces and self._closed:
                    os.close(chunk.fd)
                    chunk.fail("closed", "the backend was closed before this read started")
                    pieces = []
                if pieces:
                    chunk._remaining = len(pieces)
                    batch.sub_reads += len(pieces)
                    self._pending += len(pieces)
                    for offset, view in pieces:
                        self._queue.put((chunk, batch, offset, view))
            if not pieces:
                batch._chunk_done(chunk)
        return before

    def close(self) -> None:
        """Stop the reader threads after the queued reads; later submits fail as ``closed``."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def _open_and_plan(self, chunk: ChunkRead) -> list[tuple[int, memoryview]]:
        try:
            chunk.fd = self._open(chunk.path)
            st = os.fstat(chunk.fd)
        except FileNotFoundError:
            chunk.fail("missing", f"{chunk.path} is gone")
            return []
        except OSError as exc:
            reason = "untrusted" if exc.errno == errno.ELOOP else "io_error"
            chunk.fail(reason, f"open {chunk.path}: {exc}")
            return []
        mismatch = _identity_mismatch(chunk.identity, st)
        if mismatch:
            chunk.fail(mismatch, f"{chunk.path} is not the file that was indexed")
            os.close(chunk.fd)
            return []
        start, total = chunk.file_range()
        if total == 0:
            os.close(chunk.fd)
            return []
        unit = self.read_unit
        return [(start + off, chunk.dest[off : min(off + unit, total)])
                for off in range(0, total, unit)]

    def _open(self, path: str) -> int:
        flags = os.O_RDONLY | os.O_NOFOLLOW
        if self.odirect:
            try:
                return os.open(path, flags | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                logger.warning("O_DIRECT refused by the file system of %s; buffered reads", path)
                self.odirect = False
        return os.open(path, flags)

    def _worker(self) -> None:
        tid = threading.get_native_id()
        while (item := self._queue.get()) is not None:
            chunk, batch, offset, view = item
            nbytes = len(view)
            with self._cond:
                while self._inflight_bytes and self._inflight_bytes + nbytes > self._max_bytes:
                    self._cond.wait()
                self._inflight_bytes += nbytes
            try:
                if chunk.error is None and self._read(chunk, view, offset):
                    start = offset - HEADER_SIZE
                    chunk.verify(start, start + nbytes)
            except Exception as exc:  # a bug or a hostile buffer: this chunk fails, not the thread
                logger.error("kvscope disk: reader failed on %s", chunk.path, exc_info=True)
                chunk.fail("reader_error", f"{chunk.path}: {type(exc).__name__}: {exc}")
            finally:
                with self._cond:
                    self._inflight_bytes -= nbytes
                    self._pending -= 1
                    self._cond.notify_all()
            batch.tids.add(tid)
            if chunk._sub_done():
                self._finish(chunk, batch)

    def _read(self, chunk: ChunkRead, view: memoryview, offset: int) -> bool:
        """Fill ``view`` from ``offset``; False (and the chunk failed) on a short read/error."""
        if self._delay_s:
            time.sleep(self._delay_s)
        try:
            while len(view):
                got = os.preadv(chunk.fd, [view], offset)
                if got == 0:
                    chunk.fail("truncated", f"{chunk.path} ends before byte {offset}")
                    return False
                view, offset = view[got:], offset + got
        except OSError as exc:
            chunk.fail("io_error", f"read {chunk.path} at {offset}: {exc}")
            return False
        return True

    def _finish(self, chunk: ChunkRead, batch: ReadBatch) -> None:
        try:
            os.close(chunk.fd)
            chunk.verify(0, chunk.payload_len)  # blocks that straddled sub-reads
            if chunk.error is None and chunk.copy_to is not None:
                chunk.copy_to[:] = chunk.dest[: chunk.payload_len]
        except Exception as exc:
            logger.error("kvscope disk: finishing %s failed", chunk.path, exc_info=True)
            chunk.fail("reader_error", f"{chunk.path}: {type(exc).__name__}: {exc}")
        finally:
            batch._chunk_done(chunk)


def _identity_mismatch(identity: Optional[Identity], st: os.stat_result) -> Optional[str]:
    """"replaced" (another file under the name), "truncated" (size changed), or None."""
    if identity is None:
        return None
    if (st.st_dev, st.st_ino) != identity[:2]:
        return "replaced"
    return "truncated" if st.st_size != identity[2] else None
