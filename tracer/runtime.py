# SPDX-License-Identifier: Apache-2.0
"""This process's tracer: built on first use (after any fork), shut down at exit.

vLLM forks and spawns processes after general plugins have run; building the provider lazily
and per pid means every process gets its own exporter threads and its own files. Times: spans
get explicit start/end stamps, `monotonic_ns + offset`, where the offset is the run's
(`KVSCOPE_CLOCK_OFFSET_NS`, the same number the manifest records), so subtracting it gives
back CLOCK_MONOTONIC times that line up with the eBPF probes' events.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

from opentelemetry import trace

from kvscope.clock import measure_offset
from tracer import pipeline
from tracer.version import __version__

ENV_OFFSET = "KVSCOPE_CLOCK_OFFSET_NS"
SCOPE = "kvscope.tracer"

_lock = threading.Lock()
_state: dict[str, object] = {}


def clock_offset_ns() -> int:
    """The run's monotonic -> epoch offset, or one measured here when no run set it."""
    value = os.environ.get(ENV_OFFSET)
    if value:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{ENV_OFFSET}={value!r} is not an integer number of ns") from None
    return measure_offset().offset_ns


def get(service_name: str = "kvscope-vllm", prefix: str = "vllm") -> "Runtime":
    """This process's Runtime (a serving process: vLLM's), built on the first call in each."""
    pid = os.getpid()
    with _lock:
        runtime = _state.get("runtime")
        if not isinstance(runtime, Runtime) or runtime.pid != pid:
            runtime = Runtime(pipeline.build(service_name, prefix, report_disk_backends=True),
                              clock_offset_ns())
            _state["runtime"] = runtime
            atexit.register(runtime.pipeline.shutdown)
        return runtime


def peek() -> "Runtime | None":
    """This process's Runtime if one was built here, without building one."""
    runtime = _state.get("runtime")
    return runtime if isinstance(runtime, Runtime) and runtime.pid == os.getpid() else None


class Runtime:
    """A tracer plus the clock mapping every span time goes through."""

    def __init__(self, pipe: pipeline.Pipeline, offset_ns: int) -> None:
        self.pid = os.getpid()
        self.pipeline = pipe
        self.offset_ns = offset_ns
        self.tracer: trace.Tracer = pipe.provider.get_tracer(SCOPE, __version__)

    def epoch(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns

    @staticmethod
    def now() -> int:
        return time.monotonic_ns()
