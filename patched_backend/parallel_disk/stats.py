# SPDX-License-Identifier: Apache-2.0
"""Counters of one backend instance, readable at any time with ``snapshot()``."""

import threading
from collections import Counter
from typing import Any

from kvscope.contract.counters import CORRUPT_BY_REASON, DISK_BACKEND_COUNTERS
from kvscope.contract.counters import MISS_BY_REASON


class BackendStats:
    """Thread-safe counters; ``corrupt_by_reason`` splits ``corrupt_chunks`` (refused files),
    ``miss_by_reason`` counts reads that missed with the file left indexed (timeout, closed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter({name: 0 for name in DISK_BACKEND_COUNTERS})
        self._corrupt: Counter[str] = Counter()
        self._misses: Counter[str] = Counter()

    def add(self, **increments: int) -> None:
        """Add to named counters (names from contract.counters)."""
        with self._lock:
            for name, value in increments.items():
                if name not in DISK_BACKEND_COUNTERS:
                    raise KeyError(f"unknown counter {name!r}")
                self._counts[name] += value

    def corrupt(self, reason: str) -> None:
        """Count one refused chunk file."""
        with self._lock:
            self._counts["corrupt_chunks"] += 1
            self._corrupt[reason] += 1

    def miss(self, reason: str) -> None:
        """Count one read that ended as a miss for ``reason`` without refusing its file."""
        with self._lock:
            self._misses[reason] += 1

    def snapshot(self, **gauges: Any) -> dict[str, Any]:
        """Counters plus the given gauges (chunks, used_bytes, reads_in_flight, ...)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out[CORRUPT_BY_REASON] = dict(self._corrupt)
            out[MISS_BY_REASON] = dict(self._misses)
        out.update(gauges)
        return out
