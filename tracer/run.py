# SPDX-License-Identifier: Apache-2.0
"""Tracing for one `kvscope run`: the client's spans, the server's environment, the manifest.

`RunTracing` is a PhaseObserver: at the end of each phase it writes the client's queued spans,
waits until the server's processes have written theirs (they flush every FILE_FLUSH_MS), and
records `manifest.tracer` from the per-process counters in RUN/spans/stats/, with the kvscope
disk backend's counters as they stood at the end of each phase.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kvscope import rundir
from patched_backend.parallel_disk.stats import COUNTERS as DISK_COUNTERS
from tracer import pipeline
from tracer.client import ClientTracer
from tracer.runtime import ENV_OFFSET, Runtime
from tracer.vllm_plugin import ENV_TRACING

SETTLE_S = 3 * pipeline.FILE_FLUSH_MS / 1000
SETTLE_TIMEOUT_S = 15.0


class RunTracing:
    """Owns the client pipeline of one run and reports what all processes exported."""

    def __init__(self, run: Path, offset_ns: int) -> None:
        self.run = run
        self.spans_dir = run / rundir.SPANS_DIR
        env = {**os.environ, pipeline.ENV_SPANS_DIR: str(self.spans_dir)}
        self._pipeline = pipeline.build("kvscope-client", "client", env)
        self.client = ClientTracer(Runtime(self._pipeline, offset_ns))
        self.offset_ns = offset_ns
        self._phase = ""
        self._disk_by_phase: dict[str, dict[str, Any]] = {}

    def server_env(self) -> dict[str, str]:
        """What the vLLM server needs in its environment to trace into this run."""
        return {ENV_TRACING: "1", pipeline.ENV_SPANS_DIR: str(self.spans_dir),
                ENV_OFFSET: str(self.offset_ns)}

    def start_phase(self, run: Path, phase: str, server: Any) -> None:
        """Spans carry their own phase (on the client span); only its name is kept."""
        self._phase = phase

    def stop_phase(self) -> None:
        self._pipeline.flush_files()
        wait_for_span_files(self.spans_dir)
        summary = self.summary()
        if summary["disk_backend"]:
            self._disk_by_phase[self._phase] = summary["disk_backend"]
        rundir.update_manifest(self.run, "tracer", self._with_phases(summary))

    def close(self) -> None:
        """After the server stopped: last client spans out, final counts in the manifest."""
        self._pipeline.shutdown()
        rundir.update_manifest(self.run, "tracer", self._with_phases(self.summary()))

    def summary(self) -> dict[str, Any]:
        return summarize_stats(self.spans_dir)

    def _with_phases(self, summary: dict[str, Any]) -> dict[str, Any]:
        return {**summary, "disk_backend_by_phase": dict(self._disk_by_phase)}


def disabled_summary() -> dict[str, Any]:
    return {"enabled": False, "exporters": [], "spans_dropped": 0, "export_failures": 0}


def summarize_stats(spans_dir: Path) -> dict[str, Any]:
    """manifest.tracer: every process's counters (RUN/spans/stats/*.json) summed, and the
    kvscope disk backends' counters (cumulative since the server started; {} if none ran)."""
    total: dict[str, Any] = {"enabled": True, "exporters": [], "spans_dropped": 0,
                             "export_failures": 0, "failed_spans": 0, "spans_ended": 0,
                             "spans_exported": {}, "processes": 0, "disk_backend": {}}
    for path in sorted((spans_dir / pipeline.STATS_DIR).glob("*.json")):
        try:
            stats = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now; the next summary counts it
        total["processes"] += 1
        total["exporters"] = sorted(set(total["exporters"]) | set(stats.get("exporters", ())))
        for key in ("spans_dropped", "export_failures", "failed_spans", "spans_ended"):
            total[key] += int(stats.get(key, 0))
        for name, count in stats.get("spans_exported", {}).items():
            total["spans_exported"][name] = total["spans_exported"].get(name, 0) + int(count)
        for backend in stats.get("disk_backends", ()):
            _add_disk_counters(total["disk_backend"], backend)
    return total


def _add_disk_counters(total: dict[str, Any], backend: dict[str, Any]) -> None:
    for name in DISK_COUNTERS:
        total[name] = total.get(name, 0) + int(backend.get(name, 0))
    reasons = total.setdefault("corrupt_by_reason", {})
    for reason, count in backend.get("corrupt_by_reason", {}).items():
        reasons[reason] = reasons.get(reason, 0) + int(count)


def wait_for_span_files(spans_dir: Path, settle_s: float = SETTLE_S,
                        timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Return once no span file has appeared for `settle_s` (or after `timeout_s`)."""
    started = time.monotonic()
    last, since = None, time.monotonic()
    while time.monotonic() - started < timeout_s:
        now = sorted(p.name for p in spans_dir.glob("*.json"))
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            return
        time.sleep(settle_s / 4)
