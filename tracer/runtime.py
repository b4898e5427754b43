# SPDX-License-Identifier: Apache-2.0
"""This process's tracer: built on first use (after any fork), shut down before exit.

vLLM forks and spawns processes after general plugins have run; building the provider lazily
and per pid means every process gets its own exporter threads and its own files. `get()` never
raises: if the pipeline cannot be built, the error is counted and logged once, the failure is
kept for this pid, and `get()` returns None ("tracing off in this process"), so vLLM serves as
if kvscope were not installed. Times: spans get explicit start/end stamps,
`monotonic_ns + offset`, where the offset is the run's (`KVSCOPE_CLOCK_OFFSET_NS`, the same
number the manifest records), so subtracting it gives back CLOCK_MONOTONIC times that line up
with the eBPF probes' events.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from kvscope.contract.clock import measure_offset
from kvscope.tracer import config, failsafe, metrics, pipeline
from kvscope.tracer.version import __version__

SCOPE = "kvscope.tracer"
BUILD = "pipeline.build"  # where a failed build is counted (failsafe.counts())
BUILD_FIX = ("tracing is off in this process and vLLM serves as if kvscope were not installed; "
             "fix the cause this line names, or set KVSCOPE_TRACING=0")

_lock = threading.Lock()
_state: dict[str, object] = {}


def clock_offset_ns() -> int:
    """The run's monotonic -> epoch offset, or one measured here when no (valid) run's is set."""
    offset = config.load().clock_offset_ns
    return measure_offset().offset_ns if offset is None else offset


def get(service_name: str = "kvscope-vllm", prefix: str = "vllm") -> "Runtime | None":
    """This process's Runtime (a serving process: vLLM's), built on the first call in each;
    None when it could not be built here (counted, logged once, not retried)."""
    pid = os.getpid()
    with _lock:
        if _state.get("pid") != pid:
            _state["pid"], _state["runtime"] = pid, _build(service_name, prefix)
        runtime = _state["runtime"]
        return runtime if isinstance(runtime, Runtime) else None


def _build(service_name: str, prefix: str) -> "Runtime | None":
    try:
        pipe = pipeline.build(service_name, prefix)
        stages = metrics.stage_metrics(pipeline.disk_backend_stats)
        if stages is not None:  # stage histograms for vLLM's /metrics
            pipe.span_processor.add_span_processor(stages)
        runtime = Runtime(pipe, clock_offset_ns())
    except Exception as e:
        failsafe.count(BUILD, e, fix=BUILD_FIX)
        _stats_of_failed_build(prefix)
        return None
    pipe.shutdown_at_exit()
    return runtime


def _stats_of_failed_build(prefix: str) -> None:
    """A stats file without exporters, so manifest.tracer counts this process's error."""
    try:
        spans_dir = config.load().spans_dir
        if spans_dir is not None:
            pipeline.StatsFile(spans_dir, prefix).write({"exporters": [], "spans_ended": 0,
                                                         "closed": True})
    except Exception as e:  # no stats then; the log line above still says what failed
        failsafe.count(BUILD + ".stats", e, fix=BUILD_FIX)


def reset() -> None:
    """Forget this process's Runtime or failure (tests)."""
    with _lock:
        _state.clear()


class Runtime:
    """A tracer plus the clock mapping every span time goes through."""

    def __init__(self, pipe: pipeline.Pipeline, offset_ns: int) -> None:
        self.pid = os.getpid()
        self.pipeline = pipe
        self.offset_ns = offset_ns
        self.tracer: trace.Tracer = pipe.provider.get_tracer(SCOPE, __version__)
        self._scope = InstrumentationScope(SCOPE, __version__)

    def epoch(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns

    def finished(self, name: str, parent: trace.SpanContext, start_ns: int, end_ns: int,
                 attributes: Mapping[str, Any]) -> None:
        """A span already over (monotonic [start_ns, end_ns]), a child of `parent`, handed
        straight to the pipeline's processors. Most of kvscope's spans are made after the fact,
        so the SDK's Span lifecycle buys them nothing and cost 70-90 µs of the serving
        thread's CPU a span on the 2-core VM (attribute cleaning, a sampler asked again what
        the request's sampled parent decided, locks), this 11-19. Attribute values of types
        OTLP cannot carry are left out, as the SDK leaves them out."""
        if not parent.trace_flags.sampled:
            return
        context = trace.SpanContext(parent.trace_id, self.pipeline.provider.id_generator
                                    .generate_span_id(), False, parent.trace_flags,
                                    parent.trace_state)
        self.pipeline.span_processor.on_end(ReadableSpan(
            name=name, context=context, parent=parent, resource=self.pipeline.provider.resource,
            attributes={k: v for k, v in attributes.items() if _is_value(v)},
            kind=trace.SpanKind.INTERNAL, instrumentation_scope=self._scope,
            start_time=self.epoch(start_ns), end_time=self.epoch(max(end_ns, start_ns))))


_SCALARS = (str, bool, int, float)


def _is_value(value: Any) -> bool:
    """An attribute value OTLP carries: a scalar, or a list or tuple of scalars."""
    if isinstance(value, _SCALARS):
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, _SCALARS) for v in value)
