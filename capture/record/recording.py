"""Record a running vLLM server into a run directory: one phase, `recording`.

What kvscope's own runs get from their client and launcher, a recording gets from the server:
its spans (from its KVSCOPE_SPANS_DIR, or an OTLP receiver it was pointed at), the probes on its
engine-core and worker processes and the disks of its LMCache paths, and its /metrics before
and after. requests.parquet stays empty (no client of ours sent anything): analysis makes each
request's row from its server request span (analysis.server_requests).

A recording often runs as root and everything it takes from the server is the server's user's
to shape, so it takes it as contract.files says: from a directory private to that user, only
regular files of that user, never through a link, each and all of them capped; the server's
config and HTTP answers capped and type-checked. What it refuses is a line in `missing`.
"""

from __future__ import annotations

import getpass
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvscope.contract import files, host, jsonfiles, manifest, rundir, spantable
from kvscope.contract.clock import measure_offset
from kvscope.capture.record import bounded_http
from kvscope.capture.record.otlp_receiver import OtlpListener
from kvscope.capture.record.server_processes import ServingProcesses, lmcache_disk_paths
from kvscope.capture.workload import system, vllm_metrics

PHASE = "recording"
SETTLE_S = 1.0  # the server's file exporter flushes every 200 ms
MAX_SPAN_FILE_BYTES = rundir.SPAN_FILE_MAX_BYTES  # what analysis reads of one span file
MAX_SPAN_BYTES = 16 << 30  # all span files copied
MAX_SPAN_FILES = 1_000_000  # a busy server writes ~15 files a second: ~18 hours
METRICS_MAX_BYTES = 16 << 20  # vLLM's /metrics page is ~100 KB
MODELS_MAX_BYTES = 1 << 20
MODELS_SCHEMA = {"type": "object", "properties": {"data": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "string"}, "root": {"type": "string"}}}}}}


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
    notes: list[str] = []
    kv_dirs = opts.kv_dirs or lmcache_disk_paths(server, notes)
    devices = sorted({d for d in (host.whole_disk(p) for p in kv_dirs) if d})
    listener = _listen(opts.otlp_listen, progress) if opts.otlp_listen else None
    try:
        run = rundir.create(opts.out, _manifest(server, opts, kv_dirs, devices, notes))
        if listener is not None:
            listener.start(run / rundir.SPANS_DIR)
    except BaseException:
        if listener is not None:
            listener.stop(grace_s=0)
        raise
    recording = Recording(run, notes)
    spans_dir = run / rundir.SPANS_DIR
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
        _note_refused_requests(listener, recording)
    if source is not None and listener is None:
        _copy_span_files(server, source, spans_dir, started_wall, recording)
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
    _record_tracer_stats(run)
    _record_disk_backend(run, server, recording)
    rundir.update_manifest(run, "recording", {"missing": recording.missing,
                                              "span_files": recording.span_files,
                                              "spans_from": "otlp" if listener else "files"})
    return recording


def _listen(address: str, progress: Callable[[str], None]) -> OtlpListener:
    """The receiver, bound now (before the run exists, so a busy port leaves nothing behind)."""
    listener = OtlpListener(address)
    if not listener.loopback:
        progress(f"kvscope record: warning: --otlp-listen {address} accepts spans from any "
                 "host that can reach it (OTLP has no authentication); use 127.0.0.1:PORT "
                 "unless the server runs on another host")
    return listener


def _note_refused_requests(listener: OtlpListener, recording: Recording) -> None:
    receiver = listener.receiver
    for why, count in sorted((receiver.refused if receiver else {}).items()):
        recording.missing.append(f"spans: {count} OTLP requests refused: {why}")


def _manifest(server: ServingProcesses, opts: RecordOptions, kv_dirs: list[Path],
              devices: list[str], notes: list[str]) -> dict[str, Any]:
    return manifest.new(
        opts.out, clock=measure_offset(),
        machine=host.machine(",".join(devices), user=getpass.getuser()),
        model=_model(opts.url, notes),
        backend={"kv_dirs": [str(p) for p in kv_dirs],
                 "lmcache_config_file": server.environ.get("LMCACHE_CONFIG_FILE", "")},
        server={"url": opts.url, "api_pid": server.api_pid, "pids": list(server.pids),
                "cmdline": list(server.cmdline), "started_by": "user"},
        workload={"recorded": True, "phases": [PHASE]})


def _model(url: str, notes: list[str]) -> dict[str, Any]:
    """The served model's name and path from /v1/models ({} and a note when not readable)."""
    try:
        answer = json.loads(bounded_http.get(f"{url}/v1/models", MODELS_MAX_BYTES))
        problem = jsonfiles.shape_problem(answer, MODELS_SCHEMA)
        if problem is not None:
            raise ValueError(f"{url}/v1/models: {problem}")
    except (OSError, ValueError, RecursionError) as e:
        notes.append(f"model: {url}/v1/models could not be read ({e})")
        return {}
    models = answer.get("data") or [{}]
    return {"name": models[0].get("id", ""), "path": models[0].get("root", "")}


def _metrics(url: str, recording: Recording) -> vllm_metrics.Sample:
    try:
        return vllm_metrics.parse(bounded_http.get(f"{url}/metrics", METRICS_MAX_BYTES)
                                  .decode(errors="replace"))
    except (OSError, ValueError) as e:  # the parser's errors are ValueErrors
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


def _copy_span_files(server: ServingProcesses, source: Path, target: Path, since_wall: float,
                     recording: Recording) -> None:
    """The server's span files written since the recording started, and its stats: only when
    `source` is private to the server's user (else nobody can say who wrote what is in it),
    only regular files of that user, never through a link, within the caps."""
    from kvscope.tracer.pipeline import STATS_DIR

    time.sleep(SETTLE_S)
    try:
        files.check_private_dir(source, server.owners)
    except files.UnsafePath as e:
        recording.missing.append(f"spans: nothing copied from {source}: {e}")
        return
    copier = _Copier(server.uid, recording)
    for path in sorted(source.glob("*.json")):
        try:
            if os.lstat(path).st_mtime >= since_wall and copier.copy(path, target / path.name):
                _copy_part(path, target / path.name, server.uid)
        except FileNotFoundError:
            continue  # replaced while we looked
    stats = source / STATS_DIR
    if os.path.isdir(stats) and not os.path.islink(stats):
        files.private_dir(target / STATS_DIR)
        for path in sorted(stats.glob("*.json")):
            copier.copy(path, target / STATS_DIR / path.name)
    copier.note()


def _copy_part(span_file: Path, copied: Path, owner: int) -> None:
    """The tracer's part of `span_file` (contract.spantable.part_of) beside its copy `copied`,
    when it is a regular file of the server's user within the span file cap: the run then
    loads without parsing that file. A part not copied costs only that parsing, so it is no
    missing data and no line; the part's own record of its file tells a reader whether it is
    current (analysis.spanstream.part_rows)."""
    try:
        data = files.read_bytes(spantable.part_of(span_file), MAX_SPAN_FILE_BYTES, {owner})
    except (OSError, ValueError):  # none, or UnsafePath: a link, a FIFO, not the server's
        return
    files.private_dir(spantable.part_of(copied).parent)
    files.atomic_write(spantable.part_of(copied), data)


class _Copier:
    """Copies files of one owner through contract.files while within the recording's caps."""

    def __init__(self, owner: int, recording: Recording) -> None:
        self.owner, self.recording = owner, recording
        self.files = self.bytes = 0
        self.refused: list[str] = []
        self.capped = ""

    def copy(self, source: Path, target: Path) -> bool:
        """Whether `source` was copied to `target`."""
        if self.capped:
            return False
        if self.files >= MAX_SPAN_FILES or self.bytes >= MAX_SPAN_BYTES:
            self.capped = (f"spans: copying stopped at {self.files} files, {self.bytes} bytes "
                           f"(caps {MAX_SPAN_FILES} files, {MAX_SPAN_BYTES} bytes)")
            return False
        try:
            data = files.read_bytes(source, MAX_SPAN_FILE_BYTES, {self.owner})
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as e:  # UnsafePath: a link, a FIFO, not the server's
            self.refused.append(str(e))
            return False
        files.atomic_write(target, data)
        self.files += 1
        self.bytes += len(data)
        return True

    def note(self) -> None:
        if self.refused:
            self.recording.missing.append(
                f"spans: {len(self.refused)} files not copied (not regular files of the "
                f"server's user uid {self.owner}, or over {MAX_SPAN_FILE_BYTES} bytes), e.g. "
                f"{self.refused[0]}")
        if self.capped:
            self.recording.missing.append(self.capped)


def _record_tracer_stats(run: Path) -> None:
    from kvscope.tracer.run import summarize_stats

    rundir.update_manifest(run, "tracer", summarize_stats(run / rundir.SPANS_DIR))


def _record_disk_backend(run: Path, server: ServingProcesses, recording: Recording) -> None:
    """manifest.disk_backend from the files the server's kvscope backend writes (cumulative since
    the server started), when its environment names their directory and it is private to the
    server's user; only files of that user and of the backend's shape are summed."""
    from kvscope.patched_backend.parallel_disk import statsfile

    directory = server.backend_stats_dir
    if directory is None:
        return
    try:
        files.check_private_dir(directory, server.owners)
    except files.UnsafePath as e:
        recording.missing.append(f"disk backend counters: not read: {e}")
        return
    processes, refused = statsfile.read_files(directory, {server.uid})
    if refused:
        recording.missing.append(f"disk backend counters: {len(refused)} files refused, e.g. "
                                 f"{refused[0]}")
    counters = statsfile.sum_files(processes)
    if counters:
        rundir.update_manifest(run, "disk_backend",
                               {"counters": counters, "by_phase": {PHASE: counters}})
