# SPDX-License-Identifier: Apache-2.0
"""This process's tracer: built on first use (after any fork), closed before exit.

vLLM forks and spawns processes after general plugins have run; building the runtime lazily
and per pid means every process gets its own rings and its own link to the server's exporter
process (tracer/exporter_link.py). The serving threads only write records
(tracer/recorder.py); everything else, export included, happens in the exporter process.
`get()` never raises: if the runtime cannot be built, the error is counted and logged once,
the failure is kept for this pid, and `get()` returns None ("tracing off in this process"), so
vLLM serves as if kvscope were not installed. Times: records carry CLOCK_MONOTONIC stamps and
the exporter adds the run's offset (`KVSCOPE_CLOCK_OFFSET_NS`, the same number the manifest
records), so subtracting it gives back times that line up with the eBPF probes' events.
"""

from __future__ import annotations

import os
import threading

from opentelemetry.sdk.trace import sampling

from kvscope.contract.clock import measure_offset
from kvscope.tracer import config, exporter_link, failsafe, metrics, pipeline
from kvscope.tracer.recorder import Recorder

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
        failsafe.inject(BUILD)
        cfg = config.load()
        offset = clock_offset_ns()
        link = exporter_link.Link.join({"service": cfg.service_name or service_name,
                                        "prefix": prefix, "offset_ns": offset})
        runtime = Runtime(Recorder(link.register), offset, cfg.sampler(), link,
                          tail=cfg.tail is not None)
        metrics.publish_backend_counters(pipeline.disk_backend_stats)
    except Exception as e:
        failsafe.count(BUILD, e, fix=BUILD_FIX)
        _stats_of_failed_build(prefix)
        return None
    exporter_link.at_exit(runtime.close)
    return runtime


def _stats_of_failed_build(prefix: str) -> None:
    """A stats file without exporters, so manifest.tracer counts this process's error."""
    try:
        spans_dir = config.load().spans_dir
        if spans_dir is not None:
            pipeline.StatsFile(spans_dir, prefix, os.getpid()).write(
                {"exporters": [], "spans_ended": 0, "closed": True}, failsafe.counts())
    except Exception as e:  # no stats then; the log line above still says what failed
        failsafe.count(BUILD + ".stats", e, fix=BUILD_FIX)


def reset() -> None:
    """Close and forget this process's Runtime or failure (tests)."""
    with _lock:
        runtime = _state.get("runtime")
        if isinstance(runtime, Runtime) and runtime.pid == os.getpid():
            runtime.close()
        _state.clear()


def _after_fork_in_child() -> None:
    """A forked child must neither write its parent's rings nor hold its parent's link open
    (the exporter would wait for the child to close it); its own runtime is built anew."""
    runtime = _state.get("runtime")
    if isinstance(runtime, Runtime):
        runtime.recorder.close_inherited()
        if runtime.link is not None:
            runtime.link.abandon()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Runtime:
    """A process's recorder, the clock offset its exporter applies, and the API server's
    sampler (the other processes trace what the request's context says is sampled)."""

    def __init__(self, recorder: Recorder, offset_ns: int, sampler: sampling.Sampler,
                 link: "exporter_link.Link | None", tail: bool = False) -> None:
        self.pid = os.getpid()
        self.tail = tail  # the exporter samples by TTFT: the API server marks first tokens
        self.recorder = recorder
        self.offset_ns = offset_ns
        self.sampler = sampler
        self.link = link

    def epoch(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns

    def close(self) -> None:
        """Last records out: the exporter takes what the rings hold, then this link closes."""
        self.recorder.flush_errors()
        if self.link is not None:
            self.link.close()
