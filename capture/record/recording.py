"""Record a running vLLM server into a run directory: one phase, `recording`.

What kvscope's own runs get from their client and launcher, a recording gets from the server:
its spans (from its KVSCOPE_SPANS_DIR, or an OTLP receiver it was pointed at), the probes on its
engine-core and worker processes and the disks of its LMCache paths, and its /metrics before
and after. requests.parquet stays empty (no client of ours sent anything): analysis makes each
request's row from its server request span (analysis.server_requests).
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvscope.contract import host, manifest, rundir
from kvscope.contract.clock import measure_offset
from kvscope.capture.record.otlp_receiver import OtlpListener
from kvscope.capture.record.server_processes import ServingProcesses, lmcache_disk_paths
from kvscope.capture.workload import system, vllm_metrics

PHASE = "recording"
SETTLE_S = 1.0  # the server's file exporter flushes every 200 ms


@dataclass
class RecordOptions:
    out: Path
    url: str  # the API server's base URL (for /metrics and /v1/models)
    duration_s: float | None  # None: until stopped
    otlp_listen: str | None = None  # host:port of a receiver to run, or None: copy span files
    probes: bool = True
    kv_dirs: list[Path] = field(default_factory=list)  # default: the server's LMCache paths
    probe_mode: str = "per-io"  # or "aggregate" (probes.session)


@dataclass
class Recording:
    """What the recording found and could not do, for the manifest and the closing lines."""

    run: Path
    missing: list[str] = field(default_factory=list)
    span_files: int = 0


def record(server: ServingProcesses, opts: RecordOptions, stop: threading.Event,
           progress: Callable[[str], None] = lambda line: None) -> Recording:
    """Record `server` until `opts.duration_s` passed or `stop` is set."""
    kv_dirs = opts.kv_dirs or lmcache_disk_paths(server.environ)
    devices = sorted({d for d in (host.whole_disk(p) for p in kv_dirs) if d})
    run = rundir.create(opts.out, _manifest(server, opts, kv_dirs, devices))
    recording = Recording(run)
    spans_dir = run / rundir.SPANS_DIR
    listener = OtlpListener(opts.otlp_listen, spans_dir) if opts.otlp_listen else None
    source = server.spans_dir
    if listener is None and source is None:
        recording.missing.append(
            "spans: the server has no KVSCOPE_SPANS_DIR and no --otlp-listen was given; "
            "restart it with KVSCOPE_TRACING=1 KVSCOPE_SPANS_DIR=DIR, or point its "
            "OTEL_EXPORTER_OTLP_ENDPOINT at --otlp-listen")
    elif not server.tracing:
        recording.missing.append("spans: the server runs without KVSCOPE_TRACING=1, so it "
                                 "writes none; restart it with KVSCOPE_TRACING=1")
    probes = _start_probes(run, server, devices, opts, recording)
    metrics_before = _metrics(opts.url, recording)
    disk_before = {d: system.disk_counters(d) for d in devices}
    started_ns, started_wall = time.monotonic_ns(), time.time()
    progress(f"kvscope record: recording (probes {'on' if probes else 'off'}, spans from "
             f"{'OTLP ' + str(opts.otlp_listen) if listener else source}); Ctrl-C to stop")
    _wait(opts.duration_s, stop, started_ns, spans_dir, source, progress)
    ended_ns = time.monotonic_ns()
    if probes is not None:
        probes.stop()
    metrics_after = _metrics(opts.url, recording)
    if listener is not None:
        time.sleep(SETTLE_S)
        listener.stop()
    if source is not None and listener is None:
        _copy_span_files(source, spans_dir, started_wall)
    recording.span_files = len(list(spans_dir.glob("*.json")))
    rundir.append_table(run, "requests", rundir.empty_table("requests"))
    rundir.update_manifest(run, "phases", [{
        "name": PHASE, "kind": "recorded", "concurrency": -1,
        "started_ns": started_ns, "ended_ns": ended_ns,
        "disk_read_bytes": sum(system.disk_counters(d).read_bytes - b.read_bytes
                               for d, b in disk_before.items()),
        "vllm": vllm_metrics.delta(metrics_before, metrics_after)
        if metrics_before and metrics_after else {},
    }])
    rundir.update_manifest(run, "recording", {"missing": recording.missing,
                                              "span_files": recording.span_files,
                                              "spans_from": "otlp" if listener else "files"})
    _record_tracer_stats(run)
    _record_disk_backend(run, server)
    return recording


def _manifest(server: ServingProcesses, opts: RecordOptions, kv_dirs: list[Path],
              devices: list[str]) -> dict[str, Any]:
    return manifest.new(
        opts.out, clock=measure_offset(),
        machine=host.machine(",".join(devices), user=getpass.getuser()),
        model=_model(opts.url),
        backend={"kv_dirs": [str(p) for p in kv_dirs],
                 "lmcache_config_file": server.environ.get("LMCACHE_CONFIG_FILE", "")},
        server={"url": opts.url, "api_pid": server.api_pid, "pids": list(server.pids),
                "cmdline": list(server.cmdline), "started_by": "user"},
        workload={"recorded": True, "phases": [PHASE]})


def _model(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
            models = json.loads(response.read()).get("data") or [{}]
    except (OSError, ValueError):
        return {}
    return {"name": models[0].get("id", ""), "path": models[0].get("root", "")}


def _metrics(url: str, recording: Recording) -> vllm_metrics.Sample:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            return vllm_metrics.parse(response.read().decode())
    except OSError as e:
        note = f"vLLM metrics: {url}/metrics could not be read ({e})"
        if note not in recording.missing:
            recording.missing.append(note)
        return {}


def _start_probes(run: Path, server: ServingProcesses, devices: list[str],
                  opts: RecordOptions, recording: Recording) -> Any:
    if not opts.probes:
        recording.missing.append("probes: off (--no-probes)")
        return None
    if os.geteuid() != 0:
        recording.missing.append("probes: not root (they attach BPF programs): block_io and "
                                 "queue_depth are missing; rerun as root for the device split")
        return None
    from kvscope.probes import session

    return session.start(run, PHASE, pids=server.pids, devices=devices, mode=opts.probe_mode)


def _wait(duration_s: float | None, stop: threading.Event, started_ns: int, spans_dir: Path,
          source: Path | None, progress: Callable[[str], None]) -> None:
    deadline = None if duration_s is None else time.monotonic() + duration_s
    while not stop.is_set():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return
        stop.wait(5.0 if left is None else min(5.0, left))
        elapsed = (time.monotonic_ns() - started_ns) / 1e9
        watched = source if source is not None else spans_dir
        files = len(list(watched.glob("*.json"))) if watched.is_dir() else 0
        total = "" if duration_s is None else f" of {duration_s:.0f}"
        progress(f"kvscope record: {elapsed:.0f}{total} s, {files} span files in {watched}")


def _copy_span_files(source: Path, target: Path, since_wall: float) -> None:
    """The server's span files written since the recording started (and its stats)."""
    time.sleep(SETTLE_S)
    for path in source.glob("*.json"):
        try:
            if path.stat().st_mtime >= since_wall:
                shutil.copy2(path, target / path.name)
        except FileNotFoundError:
            continue  # replaced while we looked
    stats = source / "stats"
    if stats.is_dir():
        shutil.copytree(stats, target / "stats", dirs_exist_ok=True)


def _record_tracer_stats(run: Path) -> None:
    from kvscope.tracer.run import summarize_stats

    rundir.update_manifest(run, "tracer", summarize_stats(run / rundir.SPANS_DIR))


def _record_disk_backend(run: Path, server: ServingProcesses) -> None:
    """manifest.disk_backend from the files the server's kvscope backend writes (cumulative since
    the server started), when its environment names their directory."""
    from kvscope.patched_backend.parallel_disk import statsfile

    if server.backend_stats_dir is None:
        return
    counters = statsfile.totals(server.backend_stats_dir)
    if counters:
        rundir.update_manifest(run, "disk_backend",
                               {"counters": counters, "by_phase": {PHASE: counters}})
