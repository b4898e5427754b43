# SPDX-License-Identifier: Apache-2.0
"""Tracing for one `kvscope run`: the client's spans, the server's environment, the manifest.

`RunTracing` is a PhaseObserver: at the end of each phase it exports the client's queued spans,
waits until the server's processes have written theirs (files every FILE_FLUSH_MS) and until no
process has spans pending for any exporter (OTLP included; the stats files say), and records
`manifest.tracer` from the per-process counters in RUN/spans/stats/. After the server stopped, spans a
process still had pending are counted as lost, so per exporter
spans_ended == exported + failed + dropped + lost.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kvscope.contract import jsonfiles, rundir
from kvscope.contract.env import ENV_CLOCK_OFFSET, ENV_SPANS_DIR, ENV_TRACING
from kvscope.tracer import pipeline
from kvscope.tracer.client import ClientTracer

SETTLE_S = 3 * pipeline.FILE_FLUSH_MS / 1000
SETTLE_TIMEOUT_S = 15.0
DRAIN_TIMEOUT_S = 15.0  # a dead collector's exports fail within OTEL_EXPORTER_OTLP_TIMEOUT
COUNTS = ("accepted", "dropped", "exported", "failed", "export_failures", "lost", "pending")


class RunTracing:
    """Owns the client pipeline of one run and reports what all processes exported."""

    def __init__(self, run: Path, offset_ns: int) -> None:
        self.run = run
        self.spans_dir = run / rundir.SPANS_DIR
        env = {**os.environ, ENV_SPANS_DIR: str(self.spans_dir)}
        self._pipeline = pipeline.build("kvscope-client", "client", env)
        self.client = ClientTracer(self._pipeline, offset_ns)
        self.offset_ns = offset_ns

    def server_env(self) -> dict[str, str]:
        """What the vLLM server needs in its environment to trace into this run."""
        return {ENV_TRACING: "1", ENV_SPANS_DIR: str(self.spans_dir),
                ENV_CLOCK_OFFSET: str(self.offset_ns)}

    def start_phase(self, run: Path, phase: str, server: Any) -> None:
        """Spans carry their own phase (on the client span): nothing to do."""

    def stop_phase(self) -> None:
        self._pipeline.flush()
        wait_for_span_files(self.spans_dir)
        wait_until_drained(self.spans_dir)
        rundir.update_manifest(self.run, "tracer", self.summary())

    def close(self) -> None:
        """After the server stopped: last client spans out, final counts in the manifest."""
        self._pipeline.shutdown()
        rundir.update_manifest(self.run, "tracer", summarize_stats(self.spans_dir, final=True))

    def summary(self) -> dict[str, Any]:
        return summarize_stats(self.spans_dir)


def disabled_summary() -> dict[str, Any]:
    return {"enabled": False, "exporters": [], "spans_dropped": 0, "export_failures": 0}


def summarize_stats(spans_dir: Path, final: bool = False) -> dict[str, Any]:
    """manifest.tracer: every process's counters (RUN/spans/stats/*.json) summed, per exporter
    too, with the kvscope errors by hook and by config variable. `final`: every process has
    stopped, so what one still had pending is lost."""
    total: dict[str, Any] = {"enabled": True, "exporters": [], "spans_ended": 0,
                             "spans_exported": {}, "by_exporter": {}, "processes": 0,
                             **{key: 0 for key in pipeline.TOTALS}, "hook_errors": {},
                             "config_errors": {}}
    every, refused = stats_files(spans_dir)
    if refused:
        total["stats_files_refused"] = refused
    for stats in every:
        if "sampling" in stats:
            _add_sampling(total.setdefault("sampling", {}), stats["sampling"])
        total["processes"] += "role" not in stats  # an exporter process's own: no spans of its own
        total["exporters"] = sorted(set(total["exporters"]) | set(stats.get("exporters", ())))
        total["spans_ended"] += int(stats.get("spans_ended", 0))
        for name, counts in stats.get("by_exporter", {}).items():
            _add_exporter_counts(total, name, counts, final or bool(stats.get("closed")))
        for key in ("hook_errors", "config_errors"):
            for where, count in stats.get(key, {}).items():
                total[key][where] = total[key].get(where, 0) + int(count)
    return total


def _add_sampling(total: dict[str, Any], counts: dict[str, Any]) -> None:
    """Tail-sampling counts (tracer/tail_sampling.py) summed over exporter processes."""
    for key, value in counts.items():
        if isinstance(value, dict):
            mine = total.setdefault(key, {})
            for reason, n in value.items():
                mine[reason] = mine.get(reason, 0) + int(n)
        else:
            total[key] = total.get(key, 0) + int(value)


def read_stats(spans_dir: Path) -> list[dict[str, Any]]:
    """Every process's last written stats (one being replaced right now is skipped)."""
    return stats_files(spans_dir)[0]


def stats_files(spans_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(every process's last written stats, one line per file refused: not a regular file of
    ours, over its size cap, or not of pipeline.STATS_SCHEMA's shape)."""
    return jsonfiles.read_json_files(sorted((spans_dir / pipeline.STATS_DIR).glob("*.json")),
                                     pipeline.STATS_MAX_BYTES, pipeline.STATS_SCHEMA)


def _add_exporter_counts(total: dict[str, Any], name: str, counts: dict[str, Any],
                         stopped: bool) -> None:
    counts = {key: int(counts.get(key, 0)) for key in COUNTS}
    if stopped:  # pending in a process that has gone away: never exported
        counts["lost"] += counts["pending"]
        counts["pending"] = 0
    mine = total["by_exporter"].setdefault(name, dict.fromkeys(COUNTS, 0))
    for key, value in counts.items():
        mine[key] += value
    total["spans_exported"][name] = mine["exported"]
    for key, field in pipeline.TOTALS.items():
        total[key] += counts[field]


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


def wait_until_drained(spans_dir: Path, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Wait until no process has a span pending for any exporter; False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        pending = sum(int(counts.get("pending", 0)) for stats in read_stats(spans_dir)
                      for counts in stats.get("by_exporter", {}).values())
        if pending == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(pipeline.FILE_FLUSH_MS / 4000)
