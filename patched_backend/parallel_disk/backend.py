# SPDX-License-Identifier: Apache-2.0
"""ParallelDiskBackend: the LMCache storage plugin (configuration in docs/backend.md).

Loaded by LMCache's ``storage_plugin_launcher`` with its keyword constructor. It owns its own
path key (``kvscope.path``), so the stock LocalDiskBackend is not created alongside it.
Both LMCache read paths go through the parallel engine:

* synchronous retrieve: ``batched_get_blocking`` submits all chunks and waits;
* asynchronous prefetch (``enable_async_loading``): ``batched_get_non_blocking`` submits the
  reads *when called* and returns a coroutine that only awaits them. StorageManager wraps
  that coroutine in its global ``AsyncSingleSerializer`` lock, which therefore serialises
  only the waiting, not the I/O: concurrent requests' reads overlap at the device.

With ``prefetch_on_lookup`` the reads start earlier still, at the scheduler's lookup
(``batched_contains(..., pin=True)``), and the synchronous retrieve claims them (prefetch.py).

Every wait is bounded (``read_timeout_s``): what is not read by then is a miss, so a stuck
device or a bug never blocks vLLM's worker. The directory is private (dirsafety.py) and held
by one server at a time (dirlock.py).
"""

import asyncio
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Awaitable, Callable, Hashable, List, Optional, Sequence

from lmcache.logging import init_logger
from lmcache.utils import parse_cache_key
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from kvscope.patched_backend.parallel_disk import handoff, hooks, statsfile
from kvscope.patched_backend.parallel_disk.buffers import collapse_to_huge_pages, pool_region
from kvscope.patched_backend.parallel_disk.config import DiskConfig, from_extra_config
from kvscope.patched_backend.parallel_disk.dirlock import DirectoryLock
from kvscope.patched_backend.parallel_disk.dirsafety import prepare_private_dir
from kvscope.patched_backend.parallel_disk.geometry import EngineGeometry
from kvscope.patched_backend.parallel_disk.index import ChunkIndex, Entry
from kvscope.patched_backend.parallel_disk.io_engine import IOEngine
from kvscope.patched_backend.parallel_disk.prefetch import Prefetched, Prefetcher
from kvscope.patched_backend.parallel_disk.reads import ReadPath, Slot, Started
from kvscope.patched_backend.parallel_disk.recovery import describe, scan
from kvscope.patched_backend.parallel_disk.stats import BackendStats
from kvscope.patched_backend.parallel_disk.writer import ChunkWriter

logger = logging.getLogger(__name__)


class ParallelDiskBackend(StoragePluginInterface):
    """Disk tier with parallel O_DIRECT sub-chunk reads, verified chunk files, durable index."""

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None, loop: Optional[asyncio.AbstractEventLoop] = None
                 ) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        # LMCache's handler and level for the whole package: a vLLM server configures no root
        # logger, so without it the INFO lines (start-up, chunks found) would be dropped.
        init_logger(__package__)
        fallback_gb = float(getattr(config, "max_local_disk_size", 0.0) or 0.0)
        self.settings: DiskConfig = from_extra_config(getattr(config, "extra_config", None),
                                                      fallback_gb)
        if getattr(config, "local_disk", None) and not self.settings.write_only:
            logger.warning("LMCache local_disk is set too: the stock LocalDiskBackend also "
                           "stores every chunk; set only kvscope.path for kvscope alone")
        self.path = self.settings.path
        self._cpu_tier_caches = bool(getattr(config, "local_cpu", False))
        prepare_private_dir(self.path)
        self._lock = DirectoryLock(self.path).acquire()
        try:
            self._geometry = EngineGeometry.from_metadata(metadata)
            self._stats = BackendStats()
            self._index = ChunkIndex(self.settings.capacity)
            self._recover()
        except BaseException:
            self._lock.release()
            raise
        if self.settings.tune == "auto":
            self.settings = _tuned(self.settings)
        s = self.settings
        self._engine = IOEngine(s.effective_queue_depth, s.read_unit,
                                s.max_inflight_bytes, s.read_delay_ms, s.odirect)
        self._reads = ReadPath(self.path, s.mode, self._index, self._engine, self._stats,
                               local_cpu_backend, s.verify_checksum)
        self._writer = ChunkWriter(self.path, self._index, self._stats, s.write_threads,
                                   _capped(s.write_queue_bytes, local_cpu_backend, 2))
        self._prefetch = self._make_prefetcher(local_cpu_backend)
        hooks.register_backend(self)
        statsfile.opened()
        if s.hugepages:
            threading.Thread(target=_huge_pool, args=(local_cpu_backend,), daemon=True,
                             name="kvscope-hugepages").start()
        logger.info("kvscope disk backend at %s: %s, %d chunks (%d bytes) found on disk; "
                    "layout %s", self.path, s, len(self._index), self._index.used_bytes(),
                    self._geometry.layout)

    def __str__(self) -> str:
        return "ParallelDiskBackend"

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (chunks, used/capacity bytes, reads in flight)."""
        return self._stats.snapshot(
            path=self.path, mode=self.settings.mode, chunks=len(self._index),
            used_bytes=self._index.used_bytes(), capacity_bytes=self.settings.capacity,
            reads_in_flight=self._engine.pending(), odirect=self._engine.odirect,
            prefetch_held_bytes=self._prefetch.held_bytes() if self._prefetch else 0,
            prefetch_pending=self._prefetch.pending() if self._prefetch else 0,
            write_queued_bytes=self._writer.queued_bytes(),
            read_unit=self.settings.read_unit,
            queue_depth=self.settings.effective_queue_depth,
            max_inflight_bytes=self.settings.max_inflight_bytes, tune=self.settings.tune,
            pipeline_transfer=self.settings.pipeline_transfer,
        )

    def _make_prefetcher(self, allocator_backend: Any) -> Optional[Prefetcher]:
        """Read-ahead at lookup, budget capped at half the CPU pool (the retrieve needs room)."""
        s = self.settings
        if not s.prefetch_on_lookup:
            return None
        budget = _capped(s.prefetch_bytes, allocator_backend, 2)
        prefetcher = Prefetcher(self._reads, self._index, self._stats, budget,
                                s.prefetch_timeout_s)
        self._reads.on_pressure = prefetcher.reclaim
        logger.info("kvscope disk: reads start at lookup, up to %d MiB ahead", budget >> 20)
        return prefetcher

    # -- lookups (none hit in a write-only tier) ---------------------------------------------
    def contains(self, key: Hashable, pin: bool = False) -> bool:
        hit = not self.settings.write_only and self._index.prefix([key], pin) == 1
        self._stats.add(lookup_hits=int(hit), lookup_misses=int(not hit))
        if hit and pin and self._prefetch is not None:
            self._prefetch.on_lookup([key])
        return hit

    def batched_contains(self, keys: List[Hashable], pin: bool = False) -> int:
        """Leading hits; a pinning lookup (the scheduler's, via LMCache's lookup server)
        starts their reads when ``prefetch_on_lookup`` is on."""
        keys = list(keys)
        hits = 0 if self.settings.write_only else self._index.prefix(keys, pin)
        self._stats.add(lookup_hits=hits, lookup_misses=int(hits < len(keys)))
        if hits and pin and self._prefetch is not None:
            self._prefetch.on_lookup(keys[:hits])
        return hits

    async def batched_async_contains(self, lookup_id: str, keys: List[Hashable],
                                     pin: bool = False) -> int:
        hits = 0 if self.settings.write_only else self._index.prefix(list(keys), pin)
        self._stats.add(lookup_hits=hits, lookup_misses=int(hits < len(keys)))
        return hits

    def has_chunk(self, key: Hashable) -> bool:
        """Whether ``key`` is on disk (indexed): no pin, no counter, no LRU change (the
        tracer's chunk ledger asks this about chunks behind a missed one)."""
        return self._index.get(key) is not None

    def pin(self, key: Hashable) -> bool:
        return self._index.pin(key, +1)

    def unpin(self, key: Hashable) -> bool:
        if self._prefetch is not None:
            self._prefetch.on_unpin(key)
        return self._index.pin(key, -1)

    def touch_cache(self) -> None:
        """LRU order is updated on every served read; nothing is deferred."""

    # -- reads -----------------------------------------------------------------------------
    def get_blocking(self, key: Hashable) -> Optional[Any]:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: List[Hashable]) -> List[Optional[Any]]:
        keys = list(keys)
        claim_ns = time.monotonic_ns()
        taken: dict[Hashable, Prefetched] = {}
        # Claims are matched by key, so a get naming a key twice reads everything itself.
        if self._prefetch is not None and len(set(keys)) == len(keys):
            taken = self._prefetch.take(keys)
        request_id = hooks.current_request_id()
        deadline = time.monotonic() + self.settings.read_timeout_s
        rest = [key for key in keys if key not in taken]
        fresh: list[Optional[Slot]] = []
        if rest:
            started = self._reads.start(rest, "sync", request_id, True)
            fresh = [*started.slots(), *[None] * (len(rest) - len(started.entries))]
        unclaimed = iter(fresh)  # in key order, so a key named twice gets two slots
        slots = [taken[key].slot if key in taken else next(unclaimed) for key in keys]

        def report_claims() -> None:
            if taken:
                self._reads.report_claims([(r.batch, r.slot) for r in taken.values()
                                           if r.batch is not None and r.slot is not None],
                                          request_id, claim_ns)

        if self._hands_out():
            return handoff.hand_out(self._reads, slots, deadline, self.settings.read_timeout_s,
                                    report_claims)
        self._reads.wait(slots, deadline)
        self._reads.expire(slots, self.settings.read_timeout_s)
        report_claims()
        return self._reads.settle_slots(slots)

    def _hands_out(self) -> bool:
        """Whether this get returns chunks still being read (handoff.py): only when asked for,
        inside a pipelined get on this thread (a retrieve whose only copy waits for each chunk),
        and when LMCache's CPU tier keeps nothing (it would keep a chunk that later fails)."""
        return (self.settings.pipeline_transfer and not self._cpu_tier_caches
                and handoff.hands_out_here())

    def batched_get_non_blocking(self, lookup_id: str, keys: list[Hashable],
                                 transfer_spec: Any = None) -> Awaitable[list[Any]]:
        """Submit the reads now; the returned coroutine waits and yields the served prefix.

        Not ``async def`` on purpose (see the module docstring); the result is awaitable
        exactly like the abstract method's coroutine.
        """
        started = self._reads.start(list(keys), "async", lookup_id, busy_loop=False)
        return self._await_prefix(started)

    async def _await_prefix(self, started: Started) -> list[Any]:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        started.batch.add_done_callback(lambda _b: loop.call_soon_threadsafe(_resolve, done))
        try:
            await asyncio.wait_for(done, self.settings.read_timeout_s)
        except asyncio.TimeoutError:
            self._reads.expire(list(started.slots()), self.settings.read_timeout_s)
        served = []
        for obj in self._reads.settle(started):
            if obj is None:
                break
            obj.pin()  # as the stock backend: the engine unpins after the async retrieve
            served.append(obj)
        return served

    # -- writes ----------------------------------------------------------------------------
    def exists_in_put_tasks(self, key: Hashable) -> bool:
        return self._writer.pending(key)

    def batched_submit_put_task(self, keys: Sequence[Hashable], objs: List[Any],
                                transfer_spec: Any = None,
                                on_complete_callback: Optional[Callable[[Hashable], None]] = None
                                ) -> None:
        """Queue the stores (never blocks on disk); skipped stores are counted and logged."""
        for key, obj in zip(keys, objs, strict=True):
            header = self._geometry.header_for(key, obj)
            self._writer.submit(key, header, obj, on_complete_callback)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait for queued writes (tests, orderly shutdown); False if ``timeout`` expired."""
        return self._writer.flush(timeout)

    def remove(self, key: Hashable, force: bool = True) -> bool:
        if self._prefetch is not None:
            self._prefetch.discard(key)
        entry = self._index.remove(key)
        if entry is None:
            return False
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            pass
        return True

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        """Finish queued writes and reads, stop the threads, give the directory back."""
        if self._prefetch is not None:
            self._prefetch.close()
        self._writer.close()
        self._engine.close()
        statsfile.closed()  # its final counters, this backend still among them
        hooks.unregister_backend(self)
        self._lock.release()

    # -- start-up --------------------------------------------------------------------------
    def _recover(self) -> None:
        result = scan(self.path, self._geometry.owns, self._geometry.mismatch, _parse_key)
        for path, exc in result.refused:
            self._stats.corrupt(exc.reason)
            hooks.emit("on_corrupt", hooks.CorruptEvent(self.path, "", path, exc.reason,
                                                        str(exc), at_startup=True))
        for line in describe(result.refused):
            logger.warning("kvscope disk: %s", line)
        entries = [Entry(f.key, f.path, f.header, f.file_size, f.identity) for f in result.chunks]
        for dropped in self._index.add_scanned(entries):
            os.unlink(dropped.path)
        if result.temp_files_removed:
            logger.warning("kvscope disk: removed %d temporary files of dead writers in %s",
                           result.temp_files_removed, self.path)


def _tuned(settings: DiskConfig) -> DiskConfig:
    """``settings`` with the read knobs measured on this directory's chunk files (tune.py);
    unchanged, and said so, when there are too few to measure, a chunk claims more than tune
    reads (``tune.UnfitChunk``), or the measurement fails (a file system without O_DIRECT, a
    file removed meanwhile): the tier serves with the knobs as set."""
    from pathlib import Path

    from kvscope.patched_backend.parallel_disk import tune

    try:
        files, chunk_bytes = tune.chunk_files(Path(settings.path))
    except tune.UnfitChunk as exc:
        logger.warning("kvscope disk: tune auto: %s; knobs as set", exc)
        return settings
    if not files:
        logger.info("kvscope disk: tune auto: under %d MiB of chunks on disk, nothing to "
                    "measure; knobs as set", tune.MIN_BYTES >> 20)
        return settings
    started = time.monotonic()
    try:
        choice = tune.choose(files, chunk_bytes, tune.raw_reader,
                             tune.PathReader(settings.verify_checksum, settings.odirect))
    except OSError:  # a measurement, not a reason to refuse serving
        logger.warning("kvscope disk: tune auto could not measure %s; knobs as set",
                       settings.path, exc_info=True)
        return settings
    for line in choice.reasons:
        logger.info("kvscope disk: tune auto: %s", line)
    logger.info("kvscope disk: tune auto took %.1f s", time.monotonic() - started)
    return dataclasses.replace(settings, read_unit=choice.read_unit,
                               queue_depth=choice.queue_depth,
                               max_inflight_bytes=choice.max_inflight_bytes)


def _huge_pool(allocator_backend: Any) -> None:
    """Move LMCache's CPU pool to huge pages (buffers.collapse_to_huge_pages says why).

    In a thread: collapsing takes ~2-3 s per GB on the project VM; start-up need not wait.
    """
    region = pool_region(allocator_backend)
    if region is None:
        logger.info("kvscope disk: no CPU memory pool to move to huge pages")
        return
    started = time.monotonic()
    done, error = collapse_to_huge_pages(*region)
    logger.info("kvscope disk: %d MiB of LMCache's pool on huge pages in %.1f s%s",
                done >> 20, time.monotonic() - started, f" ({error})" if error else "")


def _parse_key(text: str) -> Hashable:
    """LMCache key of a header's key string; only its canonical spelling is accepted (one file
    per key: ``1000`` and ``01000`` would otherwise name the same chunk twice)."""
    key = parse_cache_key(text)
    if key.to_string() != text:
        raise ValueError(f"not the canonical spelling {key.to_string()!r}")
    return key


def _capped(nbytes: int, allocator_backend: Any, fraction: int) -> int:
    """``nbytes``, at most 1/``fraction`` of LMCache's CPU pool (the retrieve needs room)."""
    region = pool_region(allocator_backend)
    return nbytes if region is None else min(nbytes, region[1] // fraction)


def _resolve(future: "asyncio.Future[None]") -> None:
    if not future.done():
        future.set_result(None)

