# SPDX-License-Identifier: Apache-2.0
"""Prometheus metrics of every traced request's stages, on vLLM's own /metrics page.

A request's stages end in three processes (queue and lookup in the engine core; load, reads,
transfer, prefill and store in the worker; server TTFT in the API server), but SREs scrape one
endpoint: vLLM's `/metrics`, served by the API server from prometheus_client's registry. So
each traced process counts its ended spans into histograms (a span processor: nothing on the
serving path but a dict update) and writes them, with the kvscope disk backend's counters, as a
small JSON snapshot into a directory all of the server's processes share; the API server
registers a collector that merges the snapshots at scrape time.

The directory is `KVSCOPE_METRICS_DIR`; when unset, the first traced process (the API server,
which starts before the engine) makes one and puts it in the environment its children inherit.
Counts follow the trace sampler: an unsampled request has no spans to count.
"""

from __future__ import annotations

import bisect
import json
import multiprocessing
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from tracer import semconv

ENV_METRICS_DIR = "KVSCOPE_METRICS_DIR"
WRITE_EVERY_S = 0.2
PREFIX = "kvscope_"
STAGES = {
    semconv.SPAN_QUEUE: "queue", semconv.SPAN_KV_LOOKUP: "kv_lookup",
    semconv.SPAN_KV_LOAD: "kv_load", semconv.SPAN_STORAGE_READ: "storage_read",
    semconv.SPAN_KV_TRANSFER: "kv_transfer", semconv.SPAN_PREFILL: "prefill",
    semconv.SPAN_KV_STORE: "kv_store", semconv.SPAN_SERVER_REQUEST: "server_request",
}
SERVER_TTFT = "server_ttft"  # from the server request span's TTFT attribute
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
             25.0, 60.0, 120.0)


def metrics_dir() -> Path:
    """This server's shared snapshot directory (made, and exported to children, on first use)."""
    value = os.environ.get(ENV_METRICS_DIR)
    if not value:
        value = tempfile.mkdtemp(prefix="kvscope-metrics-")
        os.environ[ENV_METRICS_DIR] = value
    path = Path(value)
    path.mkdir(parents=True, exist_ok=True)
    return path


class StageMetrics(SpanProcessor):
    """Counts each ended span into its stage's histogram; a thread writes the snapshot."""

    def __init__(self, directory: Path, backend_stats: Any = lambda: []) -> None:
        self.path = directory / f"{os.getpid()}.json"
        self._backend_stats = backend_stats
        self._lock = threading.Lock()
        self._histograms: dict[str, list[float]] = {}  # stage -> [count per bucket..., +Inf, sum]
        self._read_bytes = 0
        self._dirty = threading.Event()
        self._closed = threading.Event()
        threading.Thread(target=self._writer, name="kvscope-metrics", daemon=True).start()

    def on_end(self, span: ReadableSpan) -> None:
        stage = STAGES.get(span.name)
        if stage is None:
            return
        attributes = span.attributes or {}
        with self._lock:
            self._observe(stage, (span.end_time - span.start_time) / 1e9)
            if stage == "server_request" and semconv.GEN_AI_TTFT in attributes:
                self._observe(SERVER_TTFT, float(attributes[semconv.GEN_AI_TTFT]))
            if stage == "storage_read":
                self._read_bytes += int(attributes.get(semconv.READ_BYTES, 0))
        self._dirty.set()

    def _observe(self, stage: str, seconds: float) -> None:
        counts = self._histograms.setdefault(stage, [0.0] * (len(BUCKETS_S) + 2))
        counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        counts[-1] += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"histograms": {k: list(v) for k, v in self._histograms.items()},
                    "storage_read_bytes": self._read_bytes,
                    "disk_backends": self._backend_stats()}

    def _writer(self) -> None:
        while not self._closed.is_set():
            if self._dirty.wait(WRITE_EVERY_S):
                self._dirty.clear()
                self._write()
                time.sleep(WRITE_EVERY_S)

    def _write(self) -> None:
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        try:
            temporary.write_text(json.dumps(self.snapshot()))
            os.replace(temporary, self.path)
        except OSError:
            pass  # a full or removed directory costs metrics, never serving

    def shutdown(self) -> None:
        self._closed.set()
        self._write()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._write()
        return True


class SnapshotCollector:
    """A prometheus_client collector merging every process's snapshot at scrape time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        snapshots = list(self._snapshots())
        stages = HistogramMetricFamily(
            f"{PREFIX}stage_duration_seconds", "Time per traced request in each kvscope stage "
            "(server_ttft: arrival at the API server to its first token)", labels=["stage"])
        for stage, counts in sorted(_merged_histograms(snapshots).items()):
            cumulative, buckets = 0.0, []
            for bound, count in zip((*map(str, BUCKETS_S), "+Inf"), counts[:-1]):
                cumulative += count
                buckets.append((bound, cumulative))
            stages.add_metric([stage], buckets, counts[-1])
        yield stages
        yield CounterMetricFamily(f"{PREFIX}storage_read_bytes", "KV bytes read from storage "
                                  "for traced requests",
                                  value=sum(s.get("storage_read_bytes", 0) for s in snapshots))
        yield from _backend_families(snapshots)

    def _snapshots(self) -> Iterator[dict[str, Any]]:
        for path in self.directory.glob("*.json"):
            try:
                yield json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being replaced; the next scrape reads it


def _merged_histograms(snapshots: list[dict[str, Any]]) -> dict[str, list[float]]:
    merged: dict[str, list[float]] = {}
    for snapshot in snapshots:
        for stage, counts in snapshot.get("histograms", {}).items():
            into = merged.setdefault(stage, [0.0] * len(counts))
            for i, value in enumerate(counts):
                into[i] += value
    return merged


def _backend_families(snapshots: list[dict[str, Any]]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily

    from patched_backend.parallel_disk.stats import COUNTERS

    totals: dict[str, float] = {name: 0 for name in COUNTERS} if snapshots else {}
    refused = CounterMetricFamily(f"{PREFIX}disk_backend_refused_chunks", "Chunks the kvscope "
                                  "disk backend refused to serve (served as misses), by reason",
                                  labels=["reason"])
    by_reason: dict[str, float] = {}
    for snapshot in snapshots:
        for backend in snapshot.get("disk_backends", ()):
            for name in COUNTERS:
                totals[name] += int(backend.get(name, 0))
            for reason, count in (backend.get("corrupt_by_reason") or {}).items():
                by_reason[reason] = by_reason.get(reason, 0) + count
    for name, value in sorted(totals.items()):
        yield CounterMetricFamily(f"{PREFIX}disk_backend_{name}",
                                  f"kvscope disk backend counter {name}", value=value)
    for reason, count in sorted(by_reason.items()):
        refused.add_metric([reason], count)
    yield refused


def start_in_this_process() -> None:
    """At plugin start-up: the shared directory exists (and is in the environment before vLLM
    starts its engine), and the top process, the API server, serves the merged snapshots on
    the registry vLLM's /metrics uses."""
    directory = metrics_dir()
    if multiprocessing.parent_process() is None:
        from prometheus_client import REGISTRY

        REGISTRY.register(SnapshotCollector(directory))
