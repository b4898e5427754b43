# SPDX-License-Identifier: Apache-2.0
"""One TracerProvider per process, its exporters chosen by the environment, loss counted.

Exporters: the run directory's OTLP JSON files when `KVSCOPE_SPANS_DIR` is set, and OTLP
(gRPC or HTTP) when the standard `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT` is set (or
`OTEL_TRACES_EXPORTER` names `otlp`; `none` turns OTLP off). Each exporter sits behind its own
BatchSpanProcessor, so a slow or dead collector never holds up the file or the caller: spans
wait in a bounded queue, and what does not fit is dropped and counted. Failures are counted
and logged once per exporter. The provider is private (not the global one), so it never
fights with vLLM's own `--otlp-traces-endpoint` tracer.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from tracer.fileexport import OtlpJsonFileExporter

logger = logging.getLogger(__name__)

ENV_SPANS_DIR = "KVSCOPE_SPANS_DIR"
FILE_FLUSH_MS = 200  # a killed worker loses at most this much of its spans
STATS_DIR = "stats"  # RUN/spans/stats/<prefix>-<pid>.json, never *.json in spans/ itself
DISK_HOOKS = "patched_backend.parallel_disk.hooks"  # kvscope's disk backend, if this process has it


@dataclass
class Counters:
    """What one process's exporters did; summed over processes into manifest.tracer."""

    spans_ended: int = 0
    spans_exported: dict[str, int] = field(default_factory=dict)
    spans_dropped: int = 0
    export_failures: int = 0
    failed_spans: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for key, value in deltas.items():
                setattr(self, key, getattr(self, key) + value)

    def exported(self, exporter: str, count: int) -> None:
        with self._lock:
            self.spans_exported[exporter] = self.spans_exported.get(exporter, 0) + count

    def as_dict(self) -> dict:
        with self._lock:
            return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


class CountingExporter(SpanExporter):
    """Counts what `inner` exported or failed; logs the first failure only."""

    def __init__(self, name: str, inner: SpanExporter, counters: Counters) -> None:
        self.name, self.inner, self.counters = name, inner, counters
        self._logged = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as e:  # an exporter must never take its thread down
            result = SpanExportResult.FAILURE
            self._log_once("%s exporter raised %r", self.name, e)
        if result is SpanExportResult.SUCCESS:
            self.counters.exported(self.name, len(spans))
        else:
            self.counters.add(export_failures=1, failed_spans=len(spans))
            self._log_once("%s exporter failed; spans are counted as lost", self.name)
        return result

    def _log_once(self, message: str, *args: object) -> None:
        if not self._logged:
            self._logged = True
            logger.warning("kvscope tracer: " + message + " (further failures only counted)",
                           *args)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _DropCountingQueue(collections.deque):
    """The batch processor's queue, counting the spans a full queue pushes out.

    Appends and the worker's pops share one lock, so "full" is checked and acted on
    atomically and the count is exact (a check outside the queue races the worker's pops).
    """

    def __init__(self, maxlen: int, counters: Counters) -> None:
        super().__init__((), maxlen)
        self._lock = threading.Lock()
        self._counters = counters

    def appendleft(self, item: object) -> None:
        with self._lock:
            if len(self) == self.maxlen:
                self._counters.add(spans_dropped=1)
            super().appendleft(item)

    def pop(self) -> object:
        with self._lock:
            return super().pop()


class CountingBatchProcessor(BatchSpanProcessor):
    """A BatchSpanProcessor that counts the spans its full queue drops."""

    def __init__(self, exporter: SpanExporter, counters: Counters, **kwargs: float) -> None:
        super().__init__(exporter, **kwargs)
        batch = self._batch_processor
        batch._queue = _DropCountingQueue(batch._max_queue_size, counters)  # SDK-private


def otlp_exporter(env: Mapping[str, str]) -> SpanExporter | None:
    """The OTLP exporter the standard OTEL_* variables ask for, or None."""
    wanted = env.get("OTEL_TRACES_EXPORTER", "").lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT")
    if "none" in wanted.split(",") or not (endpoint or "otlp" in wanted.split(",")):
        return None
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    timeout = env.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or env.get("OTEL_EXPORTER_OTLP_TIMEOUT")
    kwargs = {"timeout": float(timeout)} if timeout else {}
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, **kwargs)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPExporter,
        )

        if endpoint and not env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"  # a base URL, as the spec says
        return HTTPExporter(endpoint=endpoint, **kwargs)
    raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not supported; "
                     "use grpc (port 4317) or http/protobuf (port 4318)")


def batch_settings(env: Mapping[str, str]) -> dict[str, float]:
    """The standard OTEL_BSP_* limits from `env` (unset ones keep the SDK's defaults)."""
    names = {"OTEL_BSP_MAX_QUEUE_SIZE": "max_queue_size",
             "OTEL_BSP_SCHEDULE_DELAY": "schedule_delay_millis",
             "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "max_export_batch_size",
             "OTEL_BSP_EXPORT_TIMEOUT": "export_timeout_millis"}
    return {arg: int(env[name]) for name, arg in names.items() if env.get(name)}


@dataclass
class Pipeline:
    """A process's provider, its counters, and where its stats go."""

    provider: TracerProvider
    counters: Counters
    exporters: list[str]
    stats_path: Path | None
    file_processor: BatchSpanProcessor | None = None
    report_disk_backends: bool = False  # the serving processes' pipelines, not the client's

    def write_stats(self) -> None:
        if self.stats_path is None:
            return
        try:
            self.stats_path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.stats_path.with_suffix(".tmp")
            temporary.write_text(json.dumps({"exporters": self.exporters,
                                             **self.counters.as_dict(),
                                             "disk_backends": disk_backend_stats()
                                             if self.report_disk_backends else []}))
            os.replace(temporary, self.stats_path)
        except OSError as e:
            logger.warning("kvscope tracer: cannot write %s: %s", self.stats_path, e)

    def flush_files(self) -> None:
        """Write every queued span to the run directory now (the phase ended)."""
        if self.file_processor is not None:
            self.file_processor.force_flush()
        self.write_stats()

    def shutdown(self) -> None:
        self.provider.shutdown()
        self.write_stats()


def disk_backend_stats() -> list[dict]:
    """Counters of the kvscope disk backends alive in this process, written with the exporters'
    so `kvscope run` can report reads, refusals and read-ahead per phase. Imports nothing."""
    hooks = sys.modules.get(DISK_HOOKS)
    if hooks is None:
        return []
    try:
        return [backend.stats() for backend in hooks.live_backends()]
    except Exception:  # telemetry never breaks the exporter thread
        logger.warning("kvscope tracer: disk backend stats unavailable", exc_info=True)
        return []


def build(service_name: str, prefix: str, env: Mapping[str, str] | None = None,
          report_disk_backends: bool = False) -> Pipeline:
    """A provider exporting where `env` (default os.environ) says; see the module docstring.
    `report_disk_backends`: also write this process's disk backend counters with the stats."""
    env = os.environ if env is None else env
    counters = Counters()
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", service_name),
                                "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource)
    pipeline = Pipeline(provider, counters, [], None, report_disk_backends=report_disk_backends)
    spans_dir = env.get(ENV_SPANS_DIR)
    if spans_dir:
        files = CountingExporter("file", OtlpJsonFileExporter(spans_dir, prefix), counters)
        stats_exporter = _StatsAfterExport(files, pipeline)
        pipeline.file_processor = CountingBatchProcessor(
            stats_exporter, counters, schedule_delay_millis=FILE_FLUSH_MS)
        provider.add_span_processor(pipeline.file_processor)
        pipeline.exporters.append("file")
        pipeline.stats_path = Path(spans_dir) / STATS_DIR / f"{prefix}-{os.getpid()}.json"
    remote = otlp_exporter(env)
    if remote is not None:
        _quiet_repeated_exporter_logs()
        provider.add_span_processor(
            CountingBatchProcessor(CountingExporter("otlp", remote, counters), counters,
                                   **batch_settings(env)))
        pipeline.exporters.append("otlp")
    provider.add_span_processor(_EndCounter(counters))
    return pipeline


class _FirstOnly(logging.Filter):
    """Lets one record through: the OTLP exporters log every failed export themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        first, self.seen = not self.seen, True
        return first


_OTLP_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter",
                 "opentelemetry.exporter.otlp.proto.http.trace_exporter")


def _quiet_repeated_exporter_logs() -> None:
    for name in _OTLP_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _FirstOnly) for f in log.filters):
            log.addFilter(_FirstOnly())


class _StatsAfterExport(SpanExporter):
    """Refreshes the stats file after each file batch, so a killed process leaves its counts."""

    def __init__(self, inner: SpanExporter, pipeline: Pipeline) -> None:
        self.inner, self.pipeline = inner, pipeline

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.inner.export(spans)
        self.pipeline.write_stats()
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()


class _EndCounter(SpanProcessor):
    """Counts every ended span (the denominator of the loss figures)."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    def on_end(self, span: ReadableSpan) -> None:
        self.counters.add(spans_ended=1)
