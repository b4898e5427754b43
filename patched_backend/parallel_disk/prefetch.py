# SPDX-License-Identifier: Apache-2.0
"""Reads submitted at lookup time (knob ``prefetch_on_lookup``), claimed by the later get.

Why: LMCache's synchronous retrieve (vLLM worker ``start_load_kv``) loads the requests of a
step one after another: read request 1's chunks, copy them, read request 2's... so the disk
idles while the worker copies and prefills. The scheduler's lookup reaches the worker's
backend (``batched_contains(..., pin=True)`` from LMCache's lookup server) before those
retrieves, so every hit chunk can already be in flight; ``batched_get_blocking`` then claims
the read instead of reading again.

Bounds and lifetimes:

* bytes held by unclaimed reads stay under ``budget``; hit keys over it wait in a FIFO backlog
  and start as claims and releases free budget; no memory -> that key is not read ahead;
* a read is claimed once, and only while the index still holds the entry it read: a removed,
  evicted or replaced chunk is read again (or missed), never served from memory; a failed
  read is settled like any other (miss, refused, reported);
* unclaimed reads are released when LMCache unpins the key (``lookup_unpin`` right after the
  retrieve), after ``timeout_s``, when a blocking allocation is short of memory, and at close.
  Memory is returned only once its read has finished (readers write into it until then).
"""

import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional

from kvscope.patched_backend.parallel_disk.chunkfile import padded
from kvscope.patched_backend.parallel_disk.index import ChunkIndex
from kvscope.patched_backend.parallel_disk.io_engine import ReadBatch
from kvscope.patched_backend.parallel_disk.reads import ReadPath, Slot
from kvscope.patched_backend.parallel_disk.stats import BackendStats

logger = logging.getLogger(__name__)


@dataclass
class Prefetched:
    """A looked-up key: waiting in the backlog (``slot`` None) or read ahead into ``slot``."""

    refs: int
    deadline: float
    slot: Optional[Slot] = None
    batch: Optional[ReadBatch] = None
    nbytes: int = 0


class Prefetcher:
    """Read-ahead of looked-up chunks into LMCache memory, bounded by a byte budget."""

    def __init__(self, reads: ReadPath, index: ChunkIndex, stats: BackendStats, budget: int,
                 timeout_s: float) -> None:
        self._reads, self._index, self._stats = reads, index, stats
        self.budget, self._timeout = budget, timeout_s
        # Re-entrant: a finished batch runs its callbacks in the caller that adds them.
        self._lock = threading.RLock()
        self._records: OrderedDict[Hashable, Prefetched] = OrderedDict()  # FIFO backlog order
        self._held = 0
        self._closed = False
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, daemon=True,
                                        name="kvscope-prefetch-reaper")
        self._reaper.start()

    def held_bytes(self) -> int:
        """Bytes of memory held by reads ahead that nobody has claimed (yet)."""
        with self._lock:
            return self._held

    def pending(self) -> int:
        """Looked-up keys not claimed nor released (backlog and reads ahead)."""
        with self._lock:
            return len(self._records)

    def on_lookup(self, keys: Iterable[Hashable]) -> None:
        """``keys`` were found and pinned by a lookup: read them ahead (FIFO, within budget)."""
        deadline = time.monotonic() + self._timeout
        with self._lock:
            if self._closed:
                return
            for key in keys:
                record = self._records.get(key)
                if record is None:
                    self._records[key] = Prefetched(1, deadline)
                else:
                    record.refs += 1
                    record.deadline = deadline
            self._pump()

    def take(self, keys: list[Hashable]) -> dict[Hashable, Prefetched]:
        """Claim the reads ahead of ``keys`` whose index entry is unchanged; caller settles them."""
        taken: dict[Hashable, Prefetched] = {}
        stale: list[Prefetched] = []
        with self._lock:
            for key in keys:
                record = self._records.pop(key, None)
                if record is None or record.slot is None:
                    continue  # not looked up, or still in the backlog: the caller reads it
                if self._index.get(key) is not record.slot.entry:
                    stale.append(record)
                    continue
                self._held -= record.nbytes
                taken[key] = record
            self._stats.add(prefetch_claimed=len(taken))
            self._pump()
        self._release(stale)
        logger.debug("kvscope disk: get of %d chunks claimed %d reads ahead (%d stale)",
                     len(keys), len(taken), len(stale))
        return taken

    def on_unpin(self, key: Hashable) -> None:
        """LMCache released one lookup's pin: the read is not wanted once no lookup holds it."""
        with self._lock:
            record = self._records.get(key)
            if record is None:
                return
            record.refs -= 1
            if record.refs > 0:
                return
            del self._records[key]
        self._release([record])

    def discard(self, key: Hashable) -> None:
        """The chunk is being removed: drop its read ahead."""
        with self._lock:
            record = self._records.pop(key, None)
        self._release([record] if record else [])

    def reclaim(self, keep: list[Hashable]) -> None:
        """A blocking allocation is short of memory: drop every read ahead not for ``keep``.

        Without it a retrieve could wait for memory held by reads ahead of later requests,
        which are claimed only after that retrieve.
        """
        keep_set = set(keep)
        with self._lock:
            dropped = [self._records.pop(k) for k in list(self._records) if k not in keep_set]
        if dropped:
            logger.info("kvscope disk: CPU memory short, dropped %d reads ahead", len(dropped))
        self._release(dropped)

    def close(self) -> None:
        """Stop reading ahead; memory of unclaimed reads is returned as they finish."""
        self._stop.set()
        self._reaper.join()
        with self._lock:
            self._closed = True
            dropped = list(self._records.values())
            self._records.clear()
        self._release(dropped)

    def _pump(self) -> None:
        """Start backlog keys in FIFO order while they fit the budget (lock held)."""
        if self._closed:
            return
        chosen, need = [], 0
        for key, record in list(self._records.items()):
            if record.slot is not None:
                continue
            entry = self._index.get(key)
            if entry is None:
                del self._records[key]
                continue
            size = padded(entry.header.payload_len)
            if self._held + need + size > self.budget:
                break
            chosen.append(key)
            need += size
        if not chosen:
            return
        started = self._reads.start(chosen, "prefetch", None, busy_loop=False,
                                    count_misses=False)
        for key, slot in zip(chosen, started.slots()):
            record = self._records[key]
            record.slot, record.batch = slot, started.batch
            record.nbytes = padded(slot.entry.header.payload_len)
            self._held += record.nbytes
        for key in chosen[len(started.entries):]:
            del self._records[key]  # gone from the index or no memory: not read ahead
        self._stats.add(prefetch_reads=len(started.entries))

    def _release(self, records: list[Prefetched]) -> None:
        """Return the memory and pins of unclaimed reads once each read has finished."""
        for record in records:
            if record.slot is None or record.batch is None:
                continue
            record.batch.add_done_callback(functools.partial(self._free, record))

    def _free(self, record: Prefetched, _finished: ReadBatch) -> None:
        """``record``'s memory and pin back, called with its batch once that has finished."""
        assert record.slot is not None
        record.slot.obj.ref_count_down()
        self._index.unpin_all([record.slot.entry])
        self._stats.add(prefetch_unclaimed=1)
        with self._lock:
            self._held -= record.nbytes
            self._pump()

    def _reap_loop(self) -> None:
        while not self._stop.wait(min(1.0, self._timeout / 4)):
            now = time.monotonic()
            with self._lock:
                expired = [self._records.pop(k) for k, r in list(self._records.items())
                           if r.deadline <= now]
            self._release(expired)
