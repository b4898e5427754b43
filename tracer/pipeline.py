# SPDX-License-Identifier: Apache-2.0
"""One TracerProvider per process, its exporters chosen by the environment, loss counted.

Exporters: the run directory's OTLP JSON files when `KVSCOPE_SPANS_DIR` is set, and OTLP
(gRPC or HTTP) when the standard `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT` is set (or
`OTEL_TRACES_EXPORTER` names `otlp`; `none` turns OTLP off); settings from tracer/config.py.
Each exporter sits behind its own bounded processor (`BoundedProcessor`), so a slow or dead
collector never holds up the file or the caller: a span is handed to that exporter's
BatchSpanProcessor only while fewer than OTEL_BSP_MAX_QUEUE_SIZE of its spans are pending, and
counted as dropped otherwise. Every span ended is, per exporter, exported, failed, dropped,
still pending, or lost (pending when the process shut down): the stats add up exactly.
The provider is private (not the global one), so it never fights with vLLM's own
`--otlp-traces-endpoint` tracer.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import (ReadableSpan, Span, SpanProcessor,
                                     SynchronousMultiSpanProcessor, TracerProvider)
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from kvscope.contract import files
from kvscope.tracer import config, failsafe
from kvscope.tracer.fileexport import OtlpJsonFileExporter
from kvscope.tracer.ids import ProcessIdGenerator

logger = logging.getLogger(__name__)

FILE_FLUSH_MS = config.FILE_FLUSH_MS  # a killed worker loses at most this much of its spans
STATS_DIR = config.STATS_DIR
DISK_HOOKS = "kvscope.patched_backend.parallel_disk.hooks"  # kvscope's disk backend, if this process has it
SHUTDOWN_WAIT_S = 3.0  # vLLM SIGKILLs a worker 4 s after SIGTERM: flush, count, write before


@dataclass
class ExporterCounts:
    """One exporter's spans: ended = accepted + dropped; accepted = exported + failed + lost
    + pending (still queued or in an export call)."""

    accepted: int = 0
    dropped: int = 0  # its queue was full (or it had shut down)
    exported: int = 0
    failed: int = 0  # spans in failed export calls
    export_failures: int = 0  # failed export calls
    lost: int = 0  # still pending when the process shut down
    final: bool = field(default=False, repr=False)  # shut down: nothing counted any more

    @property
    def pending(self) -> int:
        return self.accepted - self.exported - self.failed - self.lost


@dataclass
class Counters:
    """What one process's exporters did; summed over processes into manifest.tracer."""

    spans_ended: int = 0
    exporters: dict[str, ExporterCounts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.lock = threading.Lock()

    def of(self, exporter: str) -> ExporterCounts:
        with self.lock:
            return self.exporters.setdefault(exporter, ExporterCounts())

    def as_dict(self) -> dict[str, Any]:
        """Per exporter, and the totals over all exporters (manifest.tracer's top-level keys)."""
        with self.lock:
            by = {name: {**{k: v for k, v in asdict(c).items() if k != "final"},
                         "pending": c.pending} for name, c in self.exporters.items()}
            ended = self.spans_ended
        return {"spans_ended": ended, "by_exporter": by,
                "spans_exported": {name: c["exported"] for name, c in by.items()},
                **{total: sum(c[key] for c in by.values()) for total, key in TOTALS.items()}}


TOTALS = {"spans_dropped": "dropped", "export_failures": "export_failures",
          "failed_spans": "failed", "spans_lost": "lost"}
_COUNT = {"type": "integer", "minimum": 0}
_COUNTS_BY_NAME = {"type": "object", "additionalProperties": _COUNT}
# What a stats file holds, for its readers (tracer/run.py): they sum it into manifest.tracer,
# so a file of another shape (written by something else) is refused, not summed.
STATS_SCHEMA = {
    "type": "object",
    "properties": {
        "exporters": {"type": "array", "items": {"type": "string"}},
        "spans_ended": _COUNT,
        "by_exporter": {"type": "object", "additionalProperties": {
            "type": "object", "properties": dict.fromkeys(
                ("accepted", "dropped", "exported", "failed", "export_failures", "lost",
                 "pending"), {"type": "integer"})}},
        "hook_errors": _COUNTS_BY_NAME,
        "config_errors": _COUNTS_BY_NAME,
        "closed": {"type": "boolean"},
        "role": {"type": "string"},  # "exporter": the exporter process's own file
        "records": _COUNTS_BY_NAME,  # the rings' counts (tracer/exporter.py)
        "sampling": {"type": "object", "additionalProperties": {  # the tail sampler's counts
            "anyOf": [_COUNT, _COUNTS_BY_NAME]}},
    },
}
STATS_MAX_BYTES = 1 << 20  # a process's counters are a few hundred bytes


class CountingExporter(SpanExporter):
    """Counts what `inner` exported or failed; logs the first failure only; then `after`."""

    def __init__(self, name: str, inner: SpanExporter, counters: Counters,
                 after: Callable[[], None] = lambda: None) -> None:
        self.name, self.inner, self.counters, self.after = name, inner, counters, after
        self.counts = counters.of(name)
        self._logged = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as e:  # an exporter must never take its thread down
            result = SpanExportResult.FAILURE
            self._log_once("%s exporter raised %r", self.name, e)
        with self.counters.lock:
            counting = not self.counts.final  # else counted lost by the shutdown that gave up
            if counting and result is SpanExportResult.SUCCESS:
                self.counts.exported += len(spans)
            elif counting:
                self.counts.export_failures += 1
                self.counts.failed += len(spans)
        if result is not SpanExportResult.SUCCESS:
            self._log_once("%s exporter failed; spans are counted as failed", self.name)
        self.after()
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


class BoundedProcessor(SpanProcessor):
    """A BatchSpanProcessor fed only while fewer than `max_queue_size` of its exporter's spans
    are pending, so its own queue never overflows and every span not fed is counted dropped."""

    def __init__(self, exporter: CountingExporter, batch: Mapping[str, int]) -> None:
        self.exporter = exporter
        self.limit = batch["max_queue_size"]
        self.batch = BatchSpanProcessor(exporter, **batch)
        self._closed = False

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Nothing to do: spans are handed on when they end."""

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled:
            return
        counts, lock = self.exporter.counts, self.exporter.counters.lock
        with lock:
            accept = not self._closed and counts.pending < self.limit
            if accept:
                counts.accepted += 1
            else:
                counts.dropped += 1
        if accept:
            self.batch.on_end(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.batch.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Export what is queued within SHUTDOWN_WAIT_S; what is still pending then is lost."""
        with self.exporter.counters.lock:
            if self._closed:
                return
            self._closed = True
        closing = threading.Thread(target=self.batch.shutdown, daemon=True,
                                   name=f"kvscope-{self.exporter.name}-shutdown")
        closing.start()
        closing.join(SHUTDOWN_WAIT_S)
        with self.exporter.counters.lock:
            self.exporter.counts.lost += self.exporter.counts.pending
            self.exporter.counts.final = True


class _EndCounter(SpanProcessor):
    """Counts every sampled span ended (the denominator of the loss figures)."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:
            with self.counters.lock:
                self.counters.spans_ended += 1


class StatsFile:
    """RUN/spans/stats/<prefix>-<pid>.json of the serving process `pid`, replaced whole
    (several exporter threads write), in a directory made or checked private (contract.files)
    before each write."""

    def __init__(self, spans_dir: Path, prefix: str, pid: int) -> None:
        self.pid = pid
        self.path = spans_dir / STATS_DIR / f"{prefix}-{pid}.json"
        self._lock = threading.Lock()

    def write(self, stats: Mapping[str, Any], errors: Mapping[str, int]) -> None:
        """`errors`: the serving process's kvscope error counts (tracer/failsafe.py)."""
        with self._lock:
            try:
                files.private_dir(self.path.parent)
                files.atomic_write(self.path, json.dumps(
                    {**stats, "pid": self.pid, **failsafe_stats(errors)}))
            except (OSError, files.UnsafePath) as e:
                logger.warning("kvscope tracer: cannot write %s: %s", self.path, e)


def failsafe_stats(errors: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """A process's kvscope errors: `hook_errors` by hook, `config_errors` by variable."""
    hooks, configs = {}, {}
    for where, n in errors.items():
        if where.startswith(failsafe.CONFIG):
            configs[where[len(failsafe.CONFIG):]] = n
        else:
            hooks[where] = n
    return {"hook_errors": hooks, "config_errors": configs}


@dataclass
class Pipeline:
    """A process's provider, its counters, and where its stats go. `span_processor` is every
    processor an ended span goes to (the provider's one), for spans made without the SDK's
    Span (runtime.Runtime.finished)."""

    provider: TracerProvider
    counters: Counters
    config: config.TracerConfig
    span_processor: SynchronousMultiSpanProcessor = field(
        default_factory=SynchronousMultiSpanProcessor)
    stats_file: StatsFile | None = None
    processors: dict[str, BoundedProcessor] = field(default_factory=dict)
    closed: bool = False
    errors: Callable[[], Mapping[str, int]] = failsafe.counts  # the serving process's
    amend: Callable[[dict[str, Any]], dict[str, Any]] = lambda stats: stats  # the rings' counts

    @property
    def exporters(self) -> list[str]:
        return list(self.processors)

    def write_stats(self) -> None:
        if self.stats_file is None:
            return
        self.stats_file.write(self.amend({"exporters": self.exporters,
                                          **self.counters.as_dict(), "closed": self.closed}),
                              self.errors())

    def flush(self) -> None:
        """Export every queued span now (the phase ended), then write the stats."""
        for processor in self.processors.values():
            processor.force_flush()
        self.write_stats()

    def shutdown(self) -> None:
        """Flush and stop every exporter, count what could not be sent, write the stats.
        Idempotent: it runs from atexit and from multiprocessing's exit both."""
        if self.closed:
            return
        self.closed = True
        for processor in self.processors.values():
            processor.shutdown()
        self.write_stats()


def disk_backend_stats() -> list[dict]:
    """Counters of the kvscope disk backends alive in this process, for the stage metrics on
    vLLM's /metrics (the run directory gets them from the backend itself). Imports nothing."""
    hooks = sys.modules.get(DISK_HOOKS)
    if hooks is None:
        return []
    try:
        return [backend.stats() for backend in hooks.live_backends()]
    except Exception:  # telemetry never breaks the exporter thread
        logger.warning("kvscope tracer: disk backend stats unavailable", exc_info=True)
        return []


def otlp_exporter(otlp: config.Otlp) -> SpanExporter:
    """The OTLP exporter `otlp` describes (validated by tracer/config.py)."""
    if otlp.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=otlp.endpoint, timeout=otlp.timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HTTPExporter,
    )

    return HTTPExporter(endpoint=otlp.url(), timeout=otlp.timeout_s)


def build(service_name: str, prefix: str, env: Mapping[str, str] | None = None,
          pid: int | None = None) -> Pipeline:
    """A provider exporting where `env` (default os.environ) says the spans of process `pid`
    (default this one); see the module docstring."""
    failsafe.inject("pipeline.build")
    cfg = config.load(env)
    pid = os.getpid() if pid is None else pid
    counters = Counters()
    resource = Resource.create({"service.name": cfg.service_name or service_name,
                                "process.pid": pid})
    provider = TracerProvider(resource=resource, sampler=cfg.sampler(),
                              id_generator=ProcessIdGenerator())
    pipe = Pipeline(provider, counters, cfg)
    if cfg.spans_dir is not None:
        pipe.stats_file = StatsFile(cfg.spans_dir, prefix, pid)
        files = CountingExporter("file", OtlpJsonFileExporter(cfg.spans_dir, prefix, pid), counters,
                                 after=pipe.write_stats)
        pipe.processors["file"] = BoundedProcessor(
            files, {**cfg.batch, "schedule_delay_millis": FILE_FLUSH_MS})
    if cfg.otlp is not None:
        try:
            remote = otlp_exporter(cfg.otlp)
        except Exception as e:  # the SDK reads more OTEL_* variables itself
            failsafe.count("config.OTEL_EXPORTER_OTLP", e,
                           fix="OTLP export is off in this process; fix the OTEL_EXPORTER_OTLP_* "
                           "variable the message names")
        else:
            _quiet_repeated_exporter_logs()
            pipe.processors["otlp"] = BoundedProcessor(
                CountingExporter("otlp", remote, counters, after=pipe.write_stats), cfg.batch)
    pipe.span_processor.add_span_processor(_EndCounter(counters))  # first: before any exporter
    for processor in pipe.processors.values():
        pipe.span_processor.add_span_processor(processor)
    provider.add_span_processor(pipe.span_processor)
    return pipe


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
