# SPDX-License-Identifier: Apache-2.0
"""The chunk ledger: for every chunk a request looked up, the tier that served it or why not.

Where the facts are (LMCache 0.5.6, vLLM-CPU: scheduler and worker are different processes):
the scheduler's `get_num_new_matched_tokens` sends the prompt's chunk hashes to LMCache's
lookup server, a thread of the worker process, which calls `LMCacheEngine.lookup(hashes=,
offsets=, lookup_id=<vLLM request id>, pin=True)`; that asks `StorageManager.batched_contains`,
which walks the tiers in order (LocalCPUBackend, then the disk tier) and returns, per tier, the
keys it holds (`block_mapping`, a prefix each). So the worker sees every looked-up key and who
holds it. The misses are explained by what the same worker saw before: stores
(`StorageManager.batched_put`), CPU-tier evictions (`LocalCPUBackend.remove(force=False)`, what
its allocator calls to make room), and the kvscope disk tier's own events (store done, dropped
or failed; evicted for capacity; file refused: patched_backend/parallel_disk/hooks.py). The
parent of each key (the one before it in a lookup) finds a diverged prefix: a missed chunk
whose parent has a stored child of another hash.

A lookup's record waits (bounded, MAX_PENDING) until the worker step that runs the request: its
retrieve marks chunks the load did not serve, then it is written as one SPAN_KV_LEDGER span
in the request's trace (one array element per chunk, contract.semconv LEDGER_*). Facts are
kept for the MAX_KEYS most recently seen keys. Every wrapper runs under tracer.failsafe and
only reads: a ledger error is counted and logged once, and never changes what is served.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from kvscope.contract import chunk_outcomes
from kvscope.contract import semconv
from kvscope.tracer import failsafe

MAX_KEYS = 65536  # keys whose facts are kept (oldest forgotten first)
MAX_PENDING = 4096  # lookups waiting for their request's step (oldest dropped first)
MAX_CHILDREN = 4  # stored children remembered per key (enough to see a divergence)
CPU_BACKEND = "LocalCPUBackend"
DISK_BACKENDS = ("LocalDiskBackend", "kvscope")
# Backends that read a disk, by class, whatever name the config gave them (a storage plugin's
# name is the user's); the fs connector is a RemoteBackend whose connection is an FSConnector.
DISK_CLASSES = ("LocalDiskBackend", "ParallelDiskBackend", "RustRawBlockBackend", "GdsBackend")
PEER_CLASSES = ("RustRawBlockBackend", "RemoteBackend")  # disk ones asked by contains()


def key_text(key: Any) -> str:
    """The key as LMCache spells it (the disk backend's events carry this spelling)."""
    to_string = getattr(key, "to_string", None)
    return to_string() if callable(to_string) else str(key)


def hash_text(key: Any) -> str:
    """The chunk hash of `key` as hex (the table's chunk_hash)."""
    value = getattr(key, "chunk_hash", key)
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}" if isinstance(value, int) else str(value)


def tier_of(backend_name: str) -> str:
    if backend_name == CPU_BACKEND:
        return chunk_outcomes.TIER_CPU
    if backend_name in DISK_BACKENDS:
        return chunk_outcomes.TIER_DISK
    return chunk_outcomes.TIER_OTHER


def fs_connection(backend: Any) -> Any:
    """The FSConnector of a RemoteBackend (LMCache wraps its connectors in an
    InstrumentedRemoteConnector, holding the connector as `_connector`), else None."""
    connection = getattr(backend, "connection", None)
    connection = getattr(connection, "_connector", connection)
    return connection if type(connection).__name__ == "FSConnector" else None


def tier_of_backend(name: str, backend: Any) -> str:
    """The tier of a StorageManager backend by what it is (its class, an fs connection),
    falling back to its name."""
    kind = type(backend).__name__
    if kind == CPU_BACKEND:
        return chunk_outcomes.TIER_CPU
    if kind in DISK_CLASSES or (kind == "RemoteBackend" and fs_connection(backend) is not None):
        return chunk_outcomes.TIER_DISK
    return tier_of(name)


@dataclass
class Facts:
    """What this process saw happen to one key (times: monotonic ns, -1 = never)."""

    parent: str | None = None
    children: tuple[str, ...] = ()  # stored keys whose parent this is
    put_ns: int = -1  # StorageManager.batched_put
    cpu_evicted_ns: int = -1
    disk_stored_ns: int = -1
    disk_failed: tuple[str, str, int] | None = None  # (miss reason, detail, ns)
    disk_evicted: tuple[int, int] | None = None  # (ns, capacity bytes)
    refused: tuple[str, int] | None = None  # (backend reason, ns)


@dataclass
class Chunk:
    """One looked-up chunk and its outcome."""

    start: int
    end: int
    key: str
    hash: str
    tier: str = chunk_outcomes.TIER_NONE
    reason: str = ""
    detail: str = ""
    fact_ns: int = -1
    stored_ns: int = -1
    diverged_at: int = -1


@dataclass
class Record:
    """One request's lookup, chunk by chunk, until it is written."""

    vllm_request_id: str
    start_ns: int
    end_ns: int
    chunks: list[Chunk] = field(default_factory=list)


class Ledger:
    """Facts per key and lookups per request, both bounded; thread-safe (one short lock)."""

    def __init__(self, max_keys: int = MAX_KEYS, max_pending: int = MAX_PENDING) -> None:
        self.max_keys, self.max_pending = max_keys, max_pending
        self._facts: OrderedDict[str, Facts] = OrderedDict()
        self._pending: OrderedDict[str, Record] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped = 0  # records dropped before their request's step
        self.disk_tier = False  # a disk tier was seen in a lookup (stores then go to disk)

    def _of(self, key: str) -> Facts:
        facts = self._facts.get(key)
        if facts is None:
            facts = self._facts[key] = Facts()
            while len(self._facts) > self.max_keys:
                self._facts.popitem(last=False)
        else:
            self._facts.move_to_end(key)
        return facts

    def __len__(self) -> int:
        return len(self._facts)

    def pending(self) -> int:
        return len(self._pending)

    # -- facts ---------------------------------------------------------------------------
    def stored(self, keys: Sequence[str], now: int) -> None:
        """StorageManager.batched_put of `keys` (a request's chunks, in token order)."""
        with self._lock:
            for key in keys:
                facts = self._of(key)
                facts.put_ns, facts.cpu_evicted_ns = now, -1
                facts.disk_failed = facts.disk_evicted = facts.refused = None
                parent = self._facts.get(facts.parent) if facts.parent else None
                if parent is not None and key not in parent.children:
                    parent.children = (*parent.children, key)[-MAX_CHILDREN:]

    def cpu_evicted(self, key: str, now: int) -> None:
        with self._lock:
            if key in self._facts:
                self._facts[key].cpu_evicted_ns = now

    def disk_store(self, key: str, ok: bool, reason: str, detail: str, now: int) -> None:
        """The disk tier wrote `key` (ok) or did not (`reason`: its StoreEvent.reason)."""
        with self._lock:
            facts = self._of(key)
            if ok:
                facts.disk_stored_ns, facts.disk_failed = now, None
                facts.disk_evicted = facts.refused = None
                return
            miss = chunk_outcomes.STORE_FAILURE_REASON.get(reason, chunk_outcomes.STORE_ERROR)
            facts.disk_failed = (miss, detail, now)

    def disk_evicted(self, key: str, now: int, capacity: int) -> None:
        with self._lock:
            self._of(key).disk_evicted = (now, capacity)

    def refused(self, key: str, reason: str, now: int) -> None:
        with self._lock:
            self._of(key).refused = (reason, now)

    # -- lookups -------------------------------------------------------------------------
    def lookup(self, vllm_request_id: str, keys: Sequence[Any], lengths: Sequence[int],
               mapping: dict[str, Sequence[Any]], chunk_size: int, start_ns: int, end_ns: int,
               present: Any = None, tiers: dict[str, str] | None = None) -> Record:
        """Classify one lookup: `keys` with their token `lengths`, `mapping` backend name ->
        the keys it served (StorageManager.batched_contains); `present(key) -> bool` says
        whether a key behind a miss is held by a tier anyway; `tiers`: backend name -> tier
        where known by what the backend is (else by its name). Kept until `take`."""
        tiers = tiers or {}
        served = {}
        for backend, held in mapping.items():
            for key in held:
                served[key_text(key)] = backend
        texts = [key_text(k) for k in keys]
        record = Record(vllm_request_id, start_ns, end_ns)
        start = 0
        for key, text, length in zip(keys, texts, lengths):
            record.chunks.append(Chunk(start, start + int(length), text, hash_text(key)))
            start += int(length)
        with self._lock:
            if any(tiers.get(b, tier_of(b)) == chunk_outcomes.TIER_DISK for b in mapping):
                self.disk_tier = True
            for i, chunk in enumerate(record.chunks):
                facts = self._of(chunk.key)
                if i:
                    facts.parent = texts[i - 1]
            missed = False
            for i, (key, chunk) in enumerate(zip(keys, record.chunks)):
                if not missed and chunk.key in served:
                    chunk.tier = tiers.get(served[chunk.key], tier_of(served[chunk.key]))
                    if chunk.tier == chunk_outcomes.TIER_OTHER:
                        chunk.detail = served[chunk.key]
                    chunk.stored_ns = self._facts[chunk.key].put_ns
                    continue
                self._explain(record.chunks, i, missed, chunk_size, present, key)
                missed = True
            while len(self._pending) >= self.max_pending:
                self._pending.popitem(last=False)
                self.dropped += 1
            self._pending[vllm_request_id] = record
        return record

    def _explain(self, chunks: list[Chunk], i: int, behind: bool, chunk_size: int,
                 present: Any, key: Any) -> None:
        """The reason chunk i missed (lock held); `behind`: an earlier chunk missed already."""
        chunk = chunks[i]
        facts = self._facts[chunk.key]
        chunk.stored_ns = facts.put_ns
        if behind and present is not None and present(key):
            chunk.reason, chunk.detail = chunk_outcomes.BEHIND_MISS, f"after chunk {_first_miss(chunks)}"
            return
        cpu_evicted = facts.cpu_evicted_ns if facts.put_ns >= 0 else -1
        if facts.refused is not None:
            chunk.reason, chunk.detail = chunk_outcomes.REFUSED, facts.refused[0]
            chunk.fact_ns = facts.refused[1]
        elif facts.disk_evicted is not None and facts.disk_evicted[0] >= cpu_evicted:
            chunk.reason, chunk.fact_ns = chunk_outcomes.EVICTED_DISK, facts.disk_evicted[0]
            chunk.detail = f"capacity {facts.disk_evicted[1]} bytes"
        elif cpu_evicted >= 0 and (facts.disk_stored_ns < 0 or facts.disk_evicted is not None):
            # the CPU tier dropped it last: the disk copy never was, failed, or went first
            chunk.reason, chunk.fact_ns = chunk_outcomes.EVICTED_CPU, cpu_evicted
            chunk.detail = "no disk copy" + (
                " (evicted from disk first)" if facts.disk_evicted is not None else
                f" ({facts.disk_failed[0]})" if facts.disk_failed is not None else "")
        elif facts.disk_failed is not None:
            chunk.reason, chunk.detail, chunk.fact_ns = facts.disk_failed
        elif facts.put_ns >= 0 and facts.disk_stored_ns < 0 and self.disk_tier:
            chunk.reason, chunk.fact_ns = chunk_outcomes.STORE_QUEUED, facts.put_ns
        elif facts.put_ns >= 0:
            chunk.reason, chunk.fact_ns = chunk_outcomes.LOAD_FAILED, facts.put_ns
            chunk.detail = "stored, and no tier holds it"
        elif i == len(chunks) - 1 and chunk.end - chunk.start < chunk_size:
            chunk.reason = chunk_outcomes.PARTIAL_CHUNK  # looked up only with save_unfull_chunk
            chunk.detail = f"{chunk.end - chunk.start} of {chunk_size} tokens"
        else:
            diverged = next((c.diverged_at for c in chunks[:i] if c.reason == chunk_outcomes.DIVERGED),
                            -1)
            parent = self._facts.get(facts.parent) if facts.parent else None
            if diverged < 0 and parent is not None and any(
                    c != chunk.key for c in parent.children):
                diverged = chunk.start
            if diverged >= 0:
                chunk.reason, chunk.diverged_at = chunk_outcomes.DIVERGED, diverged
                chunk.detail = f"prefix diverged at token {diverged}"
            else:
                chunk.reason = chunk_outcomes.NEVER_STORED

    def loaded(self, vllm_request_id: str, served: Sequence[bool]) -> None:
        """The retrieve's result per token (its returned mask): chunks a tier held at lookup
        that the load did not fully serve become misses (refused, if the disk tier refused
        them meanwhile; else load_failed)."""
        with self._lock:
            record = self._pending.get(vllm_request_id)
            if record is None:
                return
            for chunk in record.chunks:
                if chunk.tier in (chunk_outcomes.TIER_NONE, chunk_outcomes.TIER_VLLM):
                    continue
                part = served[chunk.start:chunk.end]
                if len(part) == chunk.end - chunk.start and all(part):
                    continue
                facts = self._facts.get(chunk.key)
                tier = chunk.tier
                chunk.tier = chunk_outcomes.TIER_NONE
                if facts is not None and facts.refused is not None:
                    chunk.reason, chunk.detail = chunk_outcomes.REFUSED, facts.refused[0]
                    chunk.fact_ns = facts.refused[1]
                else:
                    chunk.reason, chunk.detail = chunk_outcomes.LOAD_FAILED, f"{tier} tier at lookup"

    def take(self, vllm_request_id: str) -> Record | None:
        """The request's record, once (None when it has none or it was dropped)."""
        with self._lock:
            return self._pending.pop(vllm_request_id, None)

    def forget_all(self) -> None:
        with self._lock:
            self._facts.clear()
            self._pending.clear()


def _first_miss(chunks: list[Chunk]) -> int:
    return next(i for i, c in enumerate(chunks) if c.tier == chunk_outcomes.TIER_NONE)


def attributes(record: Record, dropped: int) -> dict[str, Any]:
    """The SPAN_KV_LEDGER attributes of a record (one array element per chunk)."""
    chunks = record.chunks
    return {
        semconv.LEDGER_START: [c.start for c in chunks],
        semconv.LEDGER_END: [c.end for c in chunks],
        semconv.LEDGER_KEY: [c.hash for c in chunks],
        semconv.LEDGER_TIER: [c.tier for c in chunks],
        semconv.LEDGER_REASON: [c.reason for c in chunks],
        semconv.LEDGER_DETAIL: [c.detail for c in chunks],
        semconv.LEDGER_FACT_NS: [c.fact_ns for c in chunks],
        semconv.LEDGER_STORED_NS: [c.stored_ns for c in chunks],
        semconv.LEDGER_DIVERGED_AT: [c.diverged_at for c in chunks],
        semconv.LEDGER_DROPPED: dropped,
    }


# -- the process's ledger and its wrappers (installed by tracer.instrumentor) ----------------
LEDGER = Ledger()
_contains: ContextVar[list | None] = ContextVar("kvscope_ledger_contains", default=None)


def on_engine_lookup(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps LMCacheEngine.lookup(...): the lookup server's pinning lookup of a request."""
    lookup_id, pin = kwargs.get("lookup_id"), kwargs.get("pin", False)
    if not lookup_id or not pin or args:
        return wrapped(*args, **kwargs)
    seen: list = []
    marker = _contains.set(seen)
    started = time.monotonic_ns()
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _contains.reset(marker)
    ended = time.monotonic_ns()
    if len(seen) != 1:  # layerwise lookups ask per chunk: not explained
        return result
    keys, mapping, manager = seen[0]
    chunk_size = int(getattr(getattr(instance, "config", None), "chunk_size", 256) or 256)
    lengths = kwargs.get("offsets")
    if lengths is None:
        total = len(kwargs.get("tokens") or ())
        lengths = [max(0, min(chunk_size, total - i * chunk_size)) for i in range(len(keys))]
    backends = dict(getattr(manager, "storage_backends", {}) or {})
    LEDGER.lookup(str(lookup_id), keys, list(lengths)[:len(keys)], mapping, chunk_size, started,
                  ended, _presence(manager),
                  {name: tier_of_backend(name, b) for name, b in backends.items()})
    return result


def on_batched_contains(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps StorageManager.batched_contains(keys, search_range, pin): who holds which key."""
    result = wrapped(*args, **kwargs)
    seen = _contains.get()
    if seen is not None:
        keys = list(args[0] if args else kwargs["keys"])
        seen.append((keys, dict(result[1]), instance))
    return result


def on_batched_put(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps StorageManager.batched_put(keys, memory_objs, ...): the chunks being stored."""
    keys = args[0] if args else kwargs.get("keys", ())
    LEDGER.stored([key_text(k) for k in keys], time.monotonic_ns())
    return wrapped(*args, **kwargs)


def on_cpu_remove(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps LocalCPUBackend.remove(key, force): force=False is its allocator's eviction."""
    result = wrapped(*args, **kwargs)
    force = args[1] if len(args) > 1 else kwargs.get("force", True)
    if result and not force:
        LEDGER.cpu_evicted(key_text(args[0] if args else kwargs["key"]), time.monotonic_ns())
    return result


def on_peer_put(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wraps batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback) of
    LMCache's raw-block plugin and RemoteBackend: each key's write outcome becomes a disk-tier
    fact, as the kvscope tier's store events are. The raw-block plugin calls back only for keys
    it wrote and fails its futures otherwise; RemoteBackend calls back after every write, done
    or not, so a key counts as stored when the connection finds it (the fs connector's file
    appears at its rename)."""
    keys = list(args[0] if args else kwargs.get("keys", ()))
    if len(args) > 3:
        args, theirs = args[:3], args[3]
    else:
        theirs = kwargs.pop("on_complete_callback", None)
    exists = getattr(fs_connection(instance), "exists_sync", None)
    reported: set[str] = set()

    def done(key: Any) -> None:
        if theirs is not None:
            theirs(key)
        with _counted("ledger.on_peer_put"):
            ok = exists(key) if callable(exists) else True
            reported.add(key_text(key))
            LEDGER.disk_store(key_text(key), ok, "" if ok else "error",
                              "" if ok else "not found after its write", time.monotonic_ns())

    def failed(future: Any) -> None:
        error = future.exception() if not future.cancelled() else None
        if error is None:
            return
        with _counted("ledger.on_peer_put"):
            for key in keys:
                if key_text(key) not in reported:
                    LEDGER.disk_store(key_text(key), False, "error", str(error),
                                      time.monotonic_ns())

    result = wrapped(*args, on_complete_callback=done, **kwargs)
    for future in result if isinstance(result, list) else ():
        future.add_done_callback(failed)
    return result


def _presence(manager: Any) -> Any:
    """`present(key)`: does any tier hold it (no pin, no counter)? None if none can say."""
    checks = []
    for name, backend in dict(getattr(manager, "storage_backends", {}) or {}).items():
        if hasattr(backend, "has_chunk"):
            checks.append(backend.has_chunk)
        elif (name == CPU_BACKEND or (type(backend).__name__ in PEER_CLASSES and tier_of_backend(
                name, backend) == chunk_outcomes.TIER_DISK)) and hasattr(backend, "contains"):
            checks.append(lambda key, b=backend: b.contains(key, False))
    if not checks:
        return None
    return lambda key: any(check(key) for check in checks)


class LedgerListener:
    """The kvscope disk tier's events (patched_backend.parallel_disk.hooks) as ledger facts.
    An error here is counted and logged once (tracer.failsafe), like a wrapper's."""

    def on_store(self, event: Any) -> None:
        with _counted("ledger.on_store"):
            LEDGER.disk_store(event.key, event.ok, event.reason or "error", event.error,
                              event.end_ns)

    def on_evict(self, event: Any) -> None:
        with _counted("ledger.on_evict"):
            at = event.at_ns if event.at_ns >= 0 else time.monotonic_ns()
            LEDGER.disk_evicted(event.key, at, event.capacity_bytes)

    def on_corrupt(self, event: Any) -> None:
        with _counted("ledger.on_corrupt"):
            if event.key:
                LEDGER.refused(event.key, event.reason, time.monotonic_ns())


@contextmanager
def _counted(where: str) -> Iterator[None]:
    try:
        yield
    except Exception as e:  # never into the backend's thread
        failsafe.count(where, e)


def served_tokens(mask: Any) -> list[bool] | None:
    """A retrieve's returned token mask as a list of bools (None if it is not one)."""
    tolist = getattr(mask, "tolist", None)
    if not callable(tolist):
        return None
    return [bool(v) for v in tolist()]

