# SPDX-License-Identifier: Apache-2.0
"""Prometheus metrics of every traced request's stages, on vLLM's own /metrics page.

A request's stages end in three processes (queue and lookup in the engine core; load, reads,
transfer, prefill and store in the worker; server TTFT in the API server), but SREs scrape one
endpoint: vLLM's `/metrics`, served by the API server. The server's exporter process sees every
process's spans and counts them into the stage histograms (nothing on the serving path); each
serving process with a kvscope disk backend publishes the backend's counters. Both are shared
in whichever of vLLM's two ways /metrics is being served:

- prometheus_client's global registry (the default): each process writes a small JSON snapshot
  into a directory the server's processes share, `KVSCOPE_METRICS_DIR` (made afresh by the API
  server at start-up and inherited by its children); a collector on the API server's registry
  merges the snapshots at scrape time.
- prometheus_client's multiprocess mode, when PROMETHEUS_MULTIPROC_DIR is set (by the user, by
  `--api-server-count` > 1, or by LMCache in a parent process): vLLM then serves only the
  metric files in that directory, so each process records into prometheus_client metrics,
  which write those files.

Counts follow the trace sampler: an unsampled request has no spans to count.
"""

from __future__ import annotations

import atexit
import bisect
import json
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from kvscope.contract import files, semconv
from kvscope.contract.counters import DISK_BACKEND_COUNTERS
from kvscope.tracer import failsafe

ENV_METRICS_DIR = "KVSCOPE_METRICS_DIR"
ENV_PROMETHEUS_MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"
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
STAGE_DURATION = (f"{PREFIX}stage_duration_seconds", "Time per traced request in each kvscope "
                  "stage (server_ttft: arrival at the API server to its first token)")
READ_BYTES = (f"{PREFIX}storage_read_bytes", "KV bytes read from storage for traced requests")
REFUSED = (f"{PREFIX}disk_backend_refused_chunks", "Chunks the kvscope disk backend refused to "
           "serve (served as misses), by reason")
BackendStats = Callable[[], list[dict[str, Any]]]
SNAPSHOT_MAX_BYTES = 1 << 20  # a process's histograms and backend counters: a few KB

_multiprocess_at_start: bool | None = None


def multiprocess_mode() -> bool:
    """Whether vLLM serves prometheus_client's multiprocess files in this server. Decided when
    the plugin starts: LMCache sets PROMETHEUS_MULTIPROC_DIR later in the processes that build
    its engine, and vLLM's API server, started without it, still serves the global registry."""
    if _multiprocess_at_start is None:
        return bool(os.environ.get(ENV_PROMETHEUS_MULTIPROC))
    return _multiprocess_at_start


def metrics_dir() -> Path | None:
    """This server's shared snapshot directory: the one its top process made, or a new one;
    None (counted and said in one line: this process's metrics are off) when the directory
    the environment names is not private to this user (contract.files)."""
    value = os.environ.get(ENV_METRICS_DIR)
    path = Path(value) if value else _new_metrics_dir()
    try:
        return files.private_dir(path)
    except files.UnsafePath as e:
        failsafe.count(failsafe.CONFIG + ENV_METRICS_DIR, e, fix="kvscope's stage metrics are "
                       f"off in this process (its spans are still exported); unset "
                       f"{ENV_METRICS_DIR} (the API server makes a private one)")
        return None


def _new_metrics_dir() -> Path:
    """A fresh directory, exported to the children started after this and removed at exit, so
    a server never counts another's (or a dead predecessor's) snapshots."""
    value = tempfile.mkdtemp(prefix="kvscope-metrics-")
    os.environ[ENV_METRICS_DIR] = value
    atexit.register(shutil.rmtree, value, ignore_errors=True)
    return Path(value)


def stage_metrics(backend_stats: BackendStats) -> "StageMetrics | None":
    """This process's span processor, recording the way vLLM serves /metrics here (None: off,
    see `metrics_dir`)."""
    if multiprocess_mode():
        return StageMetrics(MultiprocessFiles(backend_stats))
    directory = metrics_dir()
    return None if directory is None else StageMetrics(SnapshotFile(directory, backend_stats))


class StageMetrics(SpanProcessor):
    """Counts each ended span into its stage's histogram."""

    def __init__(self, sink: "SnapshotFile | MultiprocessFiles") -> None:
        self.sink = sink

    def on_end(self, span: ReadableSpan) -> None:
        if span.start_time is not None and span.end_time is not None:
            self.observe(span.name, (span.end_time - span.start_time) / 1e9,
                         span.attributes or {})

    def observe(self, name: str, seconds: float, attributes: Mapping[str, Any]) -> None:
        """One span of `name` that lasted `seconds` (the exporter process calls this for every
        span record, before tail sampling: the histograms count every request)."""
        stage = STAGES.get(name)
        if stage is None:
            return
        self.sink.observe(stage, seconds)
        ttft = attributes.get(semconv.GEN_AI_TTFT)
        if stage == "server_request" and isinstance(ttft, (int, float)):
            self.sink.observe(SERVER_TTFT, float(ttft))
        read_bytes = attributes.get(semconv.READ_BYTES)
        if stage == "storage_read" and isinstance(read_bytes, int):
            self.sink.add_read_bytes(read_bytes)

    def shutdown(self) -> None:
        self.sink.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.sink.flush()
        return True


def publish_backend_counters(backend_stats: BackendStats) -> None:
    """In a serving process: the kvscope disk backend's counters onto /metrics, checked every
    WRITE_EVERY_S on a thread of their own (the stage histograms are the exporter process's,
    tracer/exporter.py)."""
    if multiprocess_mode():
        sink: SnapshotFile | MultiprocessFiles = MultiprocessFiles(backend_stats)
    else:
        directory = metrics_dir()
        if directory is None:
            return
        sink = SnapshotFile(directory, backend_stats)

    def watch() -> None:
        last: list[dict[str, Any]] = []
        while True:
            time.sleep(WRITE_EVERY_S)
            now = backend_stats()
            if now != last:
                last = now
                sink.changed()

    threading.Thread(target=watch, name="kvscope-backend-counters", daemon=True).start()


class _Publisher:
    """A thread that publishes a sink's state every WRITE_EVERY_S while it changes, and once
    more when closed."""

    def __init__(self) -> None:
        self._dirty = threading.Event()
        self._closed = threading.Event()
        threading.Thread(target=self._run, name="kvscope-metrics", daemon=True).start()

    def changed(self) -> None:
        if not self._dirty.is_set():  # set() takes the event's lock and notifies, every time
            self._dirty.set()

    def _run(self) -> None:
        while not self._closed.is_set():
            if self._dirty.wait(WRITE_EVERY_S):
                self._dirty.clear()
                try:
                    self.flush()
                except Exception as e:  # metrics are lost, serving goes on
                    failsafe.count("metrics.publish", e, fix="kvscope's /metrics stop growing "
                                   "in this process; its spans are still exported")
                self._closed.wait(WRITE_EVERY_S)

    def flush(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closed.set()
        self.flush()


class SnapshotFile(_Publisher):
    """This process's histograms and backend counters as `<pid>.json` in the shared directory."""

    def __init__(self, directory: Path, backend_stats: BackendStats = lambda: []) -> None:
        self.path = directory / f"{os.getpid()}.json"
        self._backend_stats = backend_stats
        self._lock = threading.Lock()
        self._histograms: dict[str, list[float]] = {}  # stage -> [count per bucket..., +Inf, sum]
        self._read_bytes = 0
        super().__init__()

    def observe(self, stage: str, seconds: float) -> None:
        with self._lock:
            counts = self._histograms.setdefault(stage, [0.0] * (len(BUCKETS_S) + 2))
            counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
            counts[-1] += seconds
        self.changed()

    def add_read_bytes(self, count: int) -> None:
        with self._lock:
            self._read_bytes += count
        self.changed()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"histograms": {k: list(v) for k, v in self._histograms.items()},
                    "storage_read_bytes": self._read_bytes,
                    "disk_backends": self._backend_stats()}

    def flush(self) -> None:
        try:
            files.atomic_write(self.path, json.dumps(self.snapshot()))
        except OSError:
            pass  # a full or removed directory costs metrics, never serving


class MultiprocessFiles(_Publisher):
    """prometheus_client metrics, which in multiprocess mode write this process's values into
    PROMETHEUS_MULTIPROC_DIR; the backend's counters are added as they grow."""

    def __init__(self, backend_stats: BackendStats = lambda: []) -> None:
        from prometheus_client import Counter, Histogram

        self._backend_stats = backend_stats
        self._stages = Histogram(*STAGE_DURATION, ["stage"], buckets=BUCKETS_S, registry=None)
        self._read_bytes = Counter(*READ_BYTES, registry=None)
        self._backend = {name: Counter(*_backend_counter(name), registry=None)
                         for name in DISK_BACKEND_COUNTERS}
        self._refused = Counter(*REFUSED, ["reason"], registry=None)
        self._published: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        super().__init__()
        self.changed()  # the backend's counters appear at zero, before any span

    def observe(self, stage: str, seconds: float) -> None:
        self._stages.labels(stage).observe(seconds)
        self.changed()

    def add_read_bytes(self, count: int) -> None:
        self._read_bytes.inc(count)

    def flush(self) -> None:
        totals = _backend_totals([{"disk_backends": self._backend_stats()}])
        with self._lock:
            for (name, reason), value in totals.items():
                grown = value - self._published.get((name, reason), 0)
                if grown > 0:
                    counter = self._refused.labels(reason) if reason else self._backend[name]
                    counter.inc(grown)
                    self._published[(name, reason)] = value


def _backend_counter(name: str) -> tuple[str, str]:
    return f"{PREFIX}disk_backend_{name}", f"kvscope disk backend counter {name}"


def _backend_totals(snapshots: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """(counter, "") and ("refused", reason) summed over every backend of every snapshot."""
    totals: dict[tuple[str, str], float] = {(name, ""): 0 for name in DISK_BACKEND_COUNTERS}
    for snapshot in snapshots:
        for backend in snapshot.get("disk_backends", ()):
            for name in DISK_BACKEND_COUNTERS:
                totals[(name, "")] += int(backend.get(name, 0))
            for reason, count in (backend.get("corrupt_by_reason") or {}).items():
                totals[("refused", reason)] = totals.get(("refused", reason), 0) + count
    return totals


class SnapshotCollector:
    """A prometheus_client collector merging every process's snapshot at scrape time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        snapshots = list(self._snapshots())
        stages = HistogramMetricFamily(*STAGE_DURATION, labels=["stage"])
        for stage, counts in sorted(_merged_histograms(snapshots).items()):
            cumulative, buckets = 0.0, []
            for bound, count in zip((*map(str, BUCKETS_S), "+Inf"), counts[:-1]):
                cumulative += count
                buckets.append((bound, cumulative))
            stages.add_metric([stage], buckets, counts[-1])
        yield stages
        yield CounterMetricFamily(*READ_BYTES,
                                  value=sum(s.get("storage_read_bytes", 0) for s in snapshots))
        refused = CounterMetricFamily(*REFUSED, labels=["reason"])
        for (name, reason), value in sorted(_backend_totals(snapshots).items()):
            if reason:
                refused.add_metric([reason], value)
            elif snapshots:
                yield CounterMetricFamily(*_backend_counter(name), value=value)
        yield refused

    def _snapshots(self) -> Iterator[dict[str, Any]]:
        for path in self.directory.glob("*.json"):
            try:
                snapshot = json.loads(files.read_bytes(path, SNAPSHOT_MAX_BYTES))
            except (OSError, ValueError):
                continue  # replaced meanwhile (or not ours: UnsafePath); the next scrape reads it
            if isinstance(snapshot, dict):
                yield snapshot


def _merged_histograms(snapshots: list[dict[str, Any]]) -> dict[str, list[float]]:
    merged: dict[str, list[float]] = {}
    for snapshot in snapshots:
        for stage, counts in snapshot.get("histograms", {}).items():
            into = merged.setdefault(stage, [0.0] * len(counts))
            for i, value in enumerate(counts):
                into[i] += value
    return merged


def start_in_this_process() -> None:
    """At plugin start-up: fix this process's mode; in the global-registry mode, the top
    process, the API server, makes the shared directory (in the environment before vLLM starts
    its engine, whatever an outer process left there) and serves the merged snapshots."""
    global _multiprocess_at_start
    _multiprocess_at_start = bool(os.environ.get(ENV_PROMETHEUS_MULTIPROC))
    if _multiprocess_at_start:
        return
    if multiprocessing.parent_process() is None:  # the API server: a directory of its own
        from prometheus_client import REGISTRY

        REGISTRY.register(SnapshotCollector(_new_metrics_dir()))
    else:
        metrics_dir()
