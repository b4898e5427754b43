# SPDX-License-Identifier: Apache-2.0
"""Helpers of bench/read_path.py: chunk sets and LMCache stores per backend path.

The raw device-ceiling reader is kvscope.capture.ceiling."""

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch


# What one read_all served: each request's keys and the memory objects it got.
Served = list[tuple[list[Any], list[Any]]]


@dataclass(frozen=True)
class ChunkSet:
    """N chunks of one model's KV geometry (KV_2LTD, bf16, 256 tokens)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    count: int
    tokens: int = 256

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * self.tokens * self.kv_heads * self.head_dim * 2

    @property
    def shape(self) -> torch.Size:
        return torch.Size([2, self.layers, self.tokens, self.kv_heads * self.head_dim])


def _run_delays() -> dict[int, int]:
    """Nanoseconds each thread of this process has spent runnable but waiting for a core
    (``/proc/self/task/*/schedstat``, second field)."""
    delays = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                delays[int(tid)] = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return delays


class CpuMeter:
    """CPU this process spent (user + system, every thread) and the time its threads waited
    for a core, over a ``with`` block. Threads that end inside the block take their waiting
    with them (the kernel keeps it per thread only): the raw reader's waits are not counted."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.wait_s: Optional[float] = None
        self._times: Any = None
        self._delays: dict[int, int] = {}

    def __enter__(self) -> "CpuMeter":
        self._delays, self._times = _run_delays(), os.times()
        return self

    def __exit__(self, *exc: Any) -> None:
        times, delays = os.times(), _run_delays()
        self.cpu_s = (times.user - self._times.user) + (times.system - self._times.system)
        self.wait_s = sum(d - self._delays.get(tid, 0) for tid, d in delays.items()) / 1e9


class Store:
    """One LMCache StorageManager holding the chunk set under one backend configuration."""

    def __init__(self, label: str, chunk_set: ChunkSet, config_keys: dict[str, Any],
                 location: str) -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.pin_monitor import PinMonitor
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        self.label, self.chunk_set, self.location = label, chunk_set, location
        pool_gb = chunk_set.chunk_bytes * chunk_set.count * 1.25 / 2**30 + 0.1
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=chunk_set.tokens, local_cpu=False, max_local_cpu_size=pool_gb,
            **config_keys)
        meta = LMCacheMetadata(
            model_name=f"bench-{chunk_set.name}", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.bfloat16,
            kv_shape=(chunk_set.layers, 2, chunk_set.tokens, chunk_set.kv_heads,
                      chunk_set.head_dim))
        PinMonitor.GetOrCreate(config, meta)
        self.manager = StorageManager(config, meta, EventManager())
        if location not in self.manager.storage_backends:
            raise RuntimeError(f"{label}: backend {location} did not load")
        self.keys = [CacheEngineKey(meta.model_name, 1, 0, 0xABC000 + i, torch.bfloat16)
                     for i in range(chunk_set.count)]
        self._number = {key: i for i, key in enumerate(self.keys)}

    def fill(self) -> None:
        """Write the chunk set (chunk i is filled with a value derived from i), one chunk at a
        time: kvscope bounds its write queue (and drops what does not fit), the set is bigger."""
        backend = self.manager.storage_backends[self.location]
        deadline = time.monotonic() + 600
        for i, key in enumerate(self.keys):
            obj = self.manager.allocate(self.chunk_set.shape, torch.bfloat16)
            obj.tensor.fill_(float(i % 251))
            self.manager.batched_put([key], [obj], location=self.location)
            while backend.exists_in_put_tasks(key):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.label}: writes did not finish in 600 s")
                time.sleep(0.01)

    def read_all(self, concurrency: int) -> tuple[float, "Served"]:
        """Seconds to read every chunk (``concurrency`` requests, each one batched get) and
        what each request got, for ``check_and_release`` after the CPU meter stops: checking
        content is this bench's work, not the path's."""
        groups = [self.keys[i::concurrency] for i in range(concurrency)]
        results: list[list[Any]] = [[] for _ in groups]

        def one(n: int) -> None:
            results[n] = self.manager.batched_get(groups[n], location=self.location)

        threads = [threading.Thread(target=one, args=(n,)) for n in range(concurrency)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start, list(zip(groups, results, strict=True))

    def check_and_release(self, served: "Served") -> None:
        """Every chunk served with its own content (chunk i holds ``i % 251``); memory freed."""
        for keys, objs in served:
            for key, obj in zip(keys, objs, strict=True):
                if obj is None:
                    raise RuntimeError(f"{self.label}: chunk {key} was not served")
                expected = float(self._number[key] % 251)
                flat = obj.tensor.view(-1)
                if flat[0].item() != expected or flat[-1].item() != expected:
                    raise RuntimeError(f"{self.label}: chunk {key} has wrong content")
                obj.ref_count_down()

    def files(self) -> list[str]:
        """Chunk files on disk (the raw reader's input)."""
        directory = self.directory()
        return sorted(os.path.join(directory, n) for n in os.listdir(directory)
                      if not n.startswith("."))

    def directory(self) -> str:
        backend = self.manager.storage_backends[self.location]
        return str(backend.path)

    def close(self) -> None:
        self.manager.close()
