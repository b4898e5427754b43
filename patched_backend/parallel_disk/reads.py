# SPDX-License-Identifier: Apache-2.0
"""The read path shared by LMCache's synchronous retrieve and its asynchronous prefetch.

``start`` pins the present prefix of the keys, allocates LMCache memory objects, and hands
every chunk to the I/O engine at once; ``settle`` turns the finished batch into memory
objects, refusing (miss + report) any chunk that failed its checks. A refused chunk ends the
served prefix: LMCache only uses a contiguous prefix, so chunks after it are released.
``settle_slots`` does the same for chunks that came from several batches (reads submitted at
lookup time by prefetch.py plus reads of the rest).

A read that did not finish in time (``expire``: reason ``timeout``) or was submitted after
close (``closed``) is a miss like a refused one, but its file stays indexed; its memory goes
back to LMCache only once no reader can write into it any more.
"""

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch
from lmcache.v1.memory_management import MemoryFormat

from kvscope.patched_backend.parallel_disk import hooks
from kvscope.patched_backend.parallel_disk.buffers import direct_view, raw_view, staging_buffer
from kvscope.patched_backend.parallel_disk.index import ChunkIndex, Entry
from kvscope.patched_backend.parallel_disk.io_engine import ChunkRead, IOEngine, ReadBatch
from kvscope.patched_backend.parallel_disk.recovery import quarantine
from kvscope.patched_backend.parallel_disk.stats import BackendStats

logger = logging.getLogger(__name__)

# Refusals whose file is moved aside (it is ours and damaged); others just leave the index.
_QUARANTINE = ("checksum", "truncated")
# Misses that say nothing about the file: counted, the index entry is kept.
_TRANSIENT = ("timeout", "closed")


@dataclass
class Slot:
    """One chunk read: its pinned index entry, the memory object, the engine's record."""

    entry: Entry
    obj: Any
    chunk: ChunkRead
    batch: ReadBatch


@dataclass
class Started:
    """A batch in flight with the memory objects it reads into."""

    keys: list[Hashable]
    entries: list[Entry]
    objs: list[Any]
    batch: ReadBatch

    def slots(self) -> list[Slot]:
        """One slot per started chunk, in key order (a prefix of ``keys``)."""
        return [Slot(e, o, c, self.batch)
                for e, o, c in zip(self.entries, self.objs, self.batch.chunks, strict=True)]


class ReadPath:
    """Issues and settles batches of chunk reads for one backend."""

    def __init__(self, directory: str, mode: str, index: ChunkIndex, engine: IOEngine,
                 stats: BackendStats, allocator: Any, verify: bool) -> None:
        self._dir, self._mode, self._index, self._verify = directory, mode, index, verify
        self._engine, self._stats, self._allocator = engine, stats, allocator
        # Called when a blocking allocation would have to wait: frees memory held by reads
        # submitted ahead (prefetch.py), which could otherwise wait on this very caller.
        self.on_pressure: Optional[Callable[[list[Hashable]], None]] = None

    def start(self, keys: list[Hashable], kind: str, request_id: Optional[str],
              busy_loop: bool, count_misses: bool = True) -> Started:
        """Allocate and submit reads for the leading present ``keys``."""
        entries = self._index.acquire(keys)
        objs = self._allocate_together(entries)
        chunks = [self._chunk_read(e, o) for e, o in zip(entries, objs)]
        for entry in entries[len(objs):]:
            try:
                obj = self._allocate(entry, False)
                if obj is None and busy_loop and self._allocator is not None:
                    if self.on_pressure is not None:
                        self.on_pressure(keys)
                    obj = self._allocate(entry, True)
            except Exception:  # pins were taken: never leave them (nor the caller) hanging
                logger.error("kvscope disk: allocating %s failed; a miss", entry.header.key,
                             exc_info=True)
                obj = None
            if obj is None:
                break
            objs.append(obj)
            chunks.append(self._chunk_read(entry, obj))
        self._index.unpin_all(entries[len(objs):])
        entries = entries[: len(objs)]
        if count_misses:
            self._stats.add(read_misses=len(keys) - len(entries))
        batch = ReadBatch(chunks)
        submit = self._submit_event(batch, keys, kind, request_id)
        if submit is not None:
            batch.add_done_callback(lambda done: _emit_complete(submit, done))
        self._engine.submit(batch)
        return Started(list(keys), entries, objs, batch)

    def settle(self, started: Started) -> list[Optional[Any]]:
        """Memory objects of a finished batch, ``None`` from the first failed chunk on."""
        slots: list[Optional[Slot]] = [None] * len(started.keys)
        slots[: len(started.entries)] = started.slots()
        return self.settle_slots(slots)

    def settle_slots(self, slots: list[Optional[Slot]], handed: int = 0) -> list[Optional[Any]]:
        """Served prefix of finished chunk reads (one slot per key, None: not read).

        Releases every slot's pin, and the memory of every slot not served. The first
        ``handed`` slots were handed out before their reads ended (handoff.py): LMCache already
        holds their memory objects and frees them itself, so only their outcome is settled.
        """
        results: list[Optional[Any]] = [None] * len(slots)
        served: list[Hashable] = []
        ok_bytes, entries = 0, []
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            entries.append(slot.entry)
            if slot.chunk.error is None and len(served) == i:
                if i >= handed:
                    self.restore_metadata(slot)
                    results[i] = slot.obj
                served.append(slot.entry.key)
                ok_bytes += slot.entry.header.payload_len
                continue
            if slot.chunk.error is not None:
                self._refuse(slot.entry, slot.chunk.error)
            if i >= handed:
                release_when_done(slot)
        self._index.unpin_all(entries)
        self._index.touch(served)
        self._stats.add(read_hits=len(served), read_bytes=ok_bytes, read_batches=1,
                        read_misses=len(entries) - len(served))
        return results

    @staticmethod
    def restore_metadata(slot: Slot) -> None:
        """The chunk's token positions back on its memory object (they are in the header)."""
        positions = slot.entry.header.cached_positions
        slot.obj.metadata.cached_positions = (None if positions is None
                                              else torch.tensor(positions))

    @staticmethod
    def wait(slots: list[Optional[Slot]], deadline: float) -> None:
        """Block until every slot's chunk is done or ``deadline`` (``time.monotonic``) passed.

        A batch whose every chunk is wanted is waited for whole: one wake-up per batch, where
        waiting chunk by chunk woke the caller for nearly every chunk read. Other batches
        (read ahead, partly claimed by this get) are waited for chunk by chunk.
        """
        wanted: dict[int, list[Slot]] = {}
        for slot in slots:
            if slot is not None:
                wanted.setdefault(id(slot.batch), []).append(slot)
        for group in wanted.values():
            batch = group[0].batch
            if len(group) == len(batch.chunks):
                batch.wait(max(0.0, deadline - time.monotonic()))
                continue
            for slot in group:
                slot.chunk.wait(max(0.0, deadline - time.monotonic()))

    @staticmethod
    def expire(slots: list[Optional[Slot]], timeout_s: float) -> None:
        """Chunks still being read after the caller's deadline become misses (``timeout``)."""
        for slot in slots:
            if slot is not None and not slot.chunk.done:
                slot.chunk.fail("timeout", f"{slot.entry.path} not read within {timeout_s:g} s")

    def report_claims(self, claimed: list[tuple[ReadBatch, Slot]], request_id: Optional[str],
                      claim_ns: int) -> None:
        """Tell listeners which finished reads ahead a get took: one event per batch."""
        if not hooks.has_listeners():
            return
        by_batch: dict[int, tuple[ReadBatch, list[ChunkRead]]] = {}
        for batch, slot in claimed:
            by_batch.setdefault(id(batch), (batch, []))[1].append(slot.chunk)
        for batch, chunks in by_batch.values():
            hooks.emit("on_read_claim", hooks.ReadClaimEvent(
                backend_path=self._dir, mode=self._mode, request_id=request_id,
                keys=tuple(c.key for c in chunks),
                bytes=sum(c.payload_len for c in chunks if c.error is None),
                sub_reads=sum(self._engine.sub_reads_for(c.payload_len) for c in chunks),
                submit_ns=batch.submit_ns, claim_ns=claim_ns,
                end_ns=max(c.ready_ns for c in chunks), reader_tids=tuple(sorted(batch.tids)),
                failed_keys=tuple(c.key for c in chunks if c.error is not None),
                chunks=tuple(_record(c, batch) for c in chunks)))

    def _allocate_together(self, entries: list[Entry]) -> list[Any]:
        """Memory objects for all ``entries`` in one allocator call, when they share one shape,
        dtype and format and the pool has the room without evicting; else none (each is then
        allocated on its own, evicting or waiting as LMCache does).

        Why: one call costs about what one single allocation does (measured here: ~5 against
        ~18 us a chunk), and with 3 MiB chunks a request allocates hundreds.
        """
        if len(entries) < 2 or self._allocator is None:
            return []
        first = entries[0].header
        if any((e.header.shape, e.header.dtype, e.header.fmt)
               != (first.shape, first.dtype, first.fmt) for e in entries):
            return []
        try:
            objs = self._allocator.batched_allocate(
                torch.Size(first.shape), _dtype(first.dtype), len(entries),
                MemoryFormat[first.fmt], eviction=False, busy_loop=False)
        except Exception:  # pins were taken: the one-by-one path below still runs
            logger.warning("kvscope disk: batched allocation failed; one by one", exc_info=True)
            return []
        return list(objs) if objs is not None and len(objs) == len(entries) else []

    def _allocate(self, entry: Entry, busy_loop: bool) -> Optional[Any]:
        if self._allocator is None:
            logger.error("kvscope disk: no LMCache CPU allocator in this process (scheduler "
                         "role?); reads are misses")
            return None
        header = entry.header
        return self._allocator.allocate(
            torch.Size(header.shape), _dtype(header.dtype), MemoryFormat[header.fmt],
            busy_loop=busy_loop,
        )

    def _chunk_read(self, entry: Entry, obj: Any) -> ChunkRead:
        length = entry.header.payload_len
        dest = direct_view(obj.data_ptr, obj.get_physical_size(), length)
        copy_to = None
        if dest is None:
            dest, copy_to = staging_buffer(length), raw_view(obj.data_ptr, length)
        header = entry.header
        return ChunkRead(header.key, entry.path, length, dest,
                         header.hashes if self._verify else None, header.hash_block,
                         entry.identity, copy_to)

    def _submit_event(self, batch: ReadBatch, keys: list[Hashable], kind: str,
                      request_id: Optional[str]) -> Optional[hooks.ReadSubmitEvent]:
        if not hooks.has_listeners():
            return None
        sub_reads = sum(self._engine.sub_reads_for(c.payload_len) for c in batch.chunks)
        event = hooks.ReadSubmitEvent(
            batch_id=id(batch), backend_path=self._dir, mode=self._mode, path_kind=kind,
            request_id=request_id, keys=tuple(c.key for c in batch.chunks),
            chunk_count=len(batch.chunks), bytes=sum(c.payload_len for c in batch.chunks),
            sub_reads=sub_reads, inflight_at_submit=self._engine.pending(),
            submit_ns=batch.submit_ns,
        )
        hooks.emit("on_read_submit", event)
        return event

    def _refuse(self, entry: Entry, error: tuple[str, str]) -> None:
        reason, detail = error
        if reason in _TRANSIENT:
            self._stats.miss(reason)
            logger.warning("kvscope disk: chunk %s not served (%s): %s; counted as a miss",
                           entry.header.key, reason, detail)
            return
        self._index.remove(entry.key, only=entry)
        if reason in _QUARANTINE:
            quarantine(entry.path)
        self._stats.corrupt(reason)
        logger.warning("kvscope disk: chunk %s refused (%s): %s; counted as a miss",
                       entry.header.key, reason, detail)
        hooks.emit("on_corrupt", hooks.CorruptEvent(
            self._dir, entry.header.key, entry.path, reason, detail, at_startup=False))


def release_when_done(slot: Slot) -> None:
    """Return an unserved slot's memory now, or once its readers are done with it."""
    if slot.chunk.done:
        slot.obj.ref_count_down()
    else:
        slot.batch.add_done_callback(lambda _b: slot.obj.ref_count_down())


def _emit_complete(submit: hooks.ReadSubmitEvent, batch: ReadBatch) -> None:
    failed = tuple(c.key for c in batch.chunks if c.error is not None)
    ok = [c for c in batch.chunks if c.error is None]
    hooks.emit("on_read_complete", hooks.ReadCompleteEvent(
        submit=submit, end_ns=batch.end_ns if batch.end_ns >= 0 else time.monotonic_ns(),
        ok_chunks=len(ok), ok_bytes=sum(c.payload_len for c in ok), failed_keys=failed,
        reader_tids=tuple(sorted(batch.tids)), first_chunk_ready_ns=batch.first_ready_ns,
        chunks=tuple(_record(c, batch) for c in batch.chunks)))


def _record(chunk: ChunkRead, batch: ReadBatch) -> hooks.ChunkReadRecord:
    offset, length = chunk.file_range()
    return hooks.ChunkReadRecord(
        key=chunk.key, path=chunk.path, identity=chunk.identity, offset=offset, length=length,
        submit_ns=batch.submit_ns, ready_ns=chunk.ready_ns, failed=chunk.error is not None)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"chunk header dtype {name!r} is not a torch dtype")
    return dtype

