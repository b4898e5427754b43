"""One run: a vLLM + LMCache server driven through warm and cold phases into a run directory.

`warm` computes every prompt and lets LMCache store its chunks; each `cold` phase sends the same
prompts after the page cache is dropped, with LMCache's CPU tier off and vLLM's prefix cache off,
so every full chunk is read back from the disk.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import pandas as pd
from tqdm import tqdm

from kvscope.capture import ceiling, twins
from kvscope.contract import clock, env, host, manifest, rundir
from kvscope.capture.workload import device, peers, profiles, prompts, system, vllm_metrics
from kvscope.capture.workload.client import RequestPlan, RequestRecord, run_requests
from kvscope.capture.workload.kvdir import DEFAULT_ROOT, RunKVDir
from kvscope.capture.workload.options import RunOptions
from kvscope.capture.workload.observers import DiskBackendObserver, ProbeObserver
from kvscope.capture.workload.server import ServerConfig, VLLMServer

GIB = 1 << 30


class PhaseObserver(Protocol):
    """Something that watches each phase (probes, tracer): started before, stopped after."""

    def start_phase(self, run: Path, phase: str, server: VLLMServer) -> None: ...

    def stop_phase(self) -> None: ...


@dataclass(frozen=True)
class Phase:
    label: str  # unique within the run: warm, cold, or cold-c8 when several levels run
    kind: str  # warm or cold
    concurrency: int


def plan_phases(kinds: list[str], levels: list[int], warm_concurrency: int = 1) -> list[Phase]:
    """warm runs once (at warm_concurrency); cold runs once per concurrency level.

    Warming one prompt at a time keeps each prefill in one engine step: when vLLM splits a
    prompt across steps, LMCache stores only the chunks of its first step.
    """
    unknown = [k for k in kinds if k not in ("warm", "cold")]
    if unknown or not kinds:
        raise ValueError(f"phases must be warm and/or cold, got {kinds}")
    if not levels or min(levels) < 1 or warm_concurrency < 1:
        raise ValueError(f"concurrency levels must be >= 1, got {levels}")
    plan = []
    for kind in kinds:
        if kind == "warm":
            plan.append(Phase("warm", "warm", warm_concurrency))
        else:
            plan += [Phase("cold" if len(levels) == 1 else f"cold-c{c}", "cold", c) for c in levels]
    return plan


def validate(opts: RunOptions) -> tuple[twins.TwinSpec, profiles.Profile, list[Phase]]:
    """Check every input before anything starts; raise with what to change."""
    spec = twins.get(opts.model)
    profile = profiles.get(opts.profile)
    device.check(opts.device)
    if opts.twin is None:
        device.refuse_place(opts.device, opts.kv_dir, "--kv-dir")
    phases = plan_phases(opts.phases, opts.concurrency, opts.warm_concurrency)
    context = opts.prompt_tokens + opts.max_tokens
    if context > spec.max_position_embeddings:
        raise ValueError(
            f"--prompt-tokens {opts.prompt_tokens} + --max-tokens {opts.max_tokens} = {context} "
            f"exceeds the {spec.name} twin's context limit of {spec.max_position_embeddings}"
        )
    if opts.requests < 1 or opts.prompt_tokens < 1:
        raise ValueError("--requests and --prompt-tokens must be at least 1")
    if any(p.kind == "cold" for p in phases):
        system.require_root_for_drop_caches()
    system.check_port_free(opts.host, opts.port)
    return spec, profile, phases


def _kv_cache_gib(opts: RunOptions, spec: twins.TwinSpec) -> int:
    """Room for every request in flight at the highest concurrency, plus slack."""
    if opts.kv_cache_gib:
        return opts.kv_cache_gib
    tokens = max(opts.concurrency) * (opts.prompt_tokens + opts.max_tokens)
    return max(1, math.ceil(tokens * spec.kv_bytes_per_token * 1.25 / GIB))


def _manifest(opts: RunOptions, spec: twins.TwinSpec, profile: profiles.Profile,
              lmcache: dict, kv_dir: Path, model_dir: Path, offset: clock.ClockOffset) -> dict:
    return manifest.new(
        opts.out, command=opts.command, clock=offset,
        machine=host.machine(host.whole_disk(kv_dir)),
        model={
            "twin": spec.name, "twin_of": spec.twin_of, "path": str(model_dir),
            "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "dtype": spec.dtype,
            "kv_bytes_per_token": spec.kv_bytes_per_token, "chunk_tokens": twins.CHUNK_TOKENS,
            "kv_bytes_per_chunk": spec.kv_bytes_per_chunk,
            "max_model_len": opts.prompt_tokens + opts.max_tokens,
        },
        device=device.manifest_section(opts.twin, host.whole_disk(kv_dir)),
        backend={"profile": profile.name, "summary": profile.summary,
                 "lmcache": lmcache, "disk_path": str(kv_dir),
                 "copy_disk_path": str(opts.copy_kv_dir) if opts.copy_kv_dir else None},
        workload={
            "num_requests": opts.requests, "concurrency": opts.concurrency,
            "prompt_tokens": opts.prompt_tokens,
            "shared_prefix_tokens": opts.shared_prefix_tokens, "max_tokens": opts.max_tokens,
            "seed": opts.seed, "phases": opts.phases, "warm_concurrency": opts.warm_concurrency,
        })


def expected_chunks(prompt_ids: list[list[int]], chunk_tokens: int = twins.CHUNK_TOKENS) -> int:
    """How many chunk files LMCache stores for these prompts: their distinct full-chunk prefixes."""
    return len({tuple(p[:end]) for p in prompt_ids
                for end in range(chunk_tokens, len(p) + 1, chunk_tokens)})


IMAGE_QUIET_S = 3.0  # a raw-block image checkpoints its index ~1 s after its last write


def _stored_chunks(kv_dir: Path, chunk_bytes: int) -> tuple[int, int]:
    """(complete chunks, bytes of all files). Chunk files: dot-files and `.tmp` files (the fs
    connector's) are writes in progress. A raw-block image holds a chunk per `chunk_bytes` it
    has written (its slot headers and index are a small part; 0: images are not counted)."""
    files = [p for p in kv_dir.rglob("*") if p.is_file()]
    image = [p for p in files if p.name == peers.IMAGE]
    done = [p for p in files if p.name != peers.IMAGE and not p.name.startswith(".")
            and not p.name.endswith((".corrupt", ".tmp"))]
    written = sum(peers.allocated_bytes(p) for p in image)
    return (len(done) + (written // chunk_bytes if chunk_bytes else 0),
            sum(p.stat().st_size for p in files if p not in image) + written)


def wait_for_stores(kv_dir: Path, expected: int, chunk_bytes: int = 0, settle_s: float = 10.0,
                    timeout_s: float = 600.0) -> int:
    """Wait for LMCache's asynchronous writes: until `expected` chunks are complete and quiet
    for a moment (long enough for a raw-block image to checkpoint its index), or nothing has
    changed for settle_s. Returns the chunks found."""
    quiet = IMAGE_QUIET_S if (kv_dir / peers.IMAGE).exists() else 0.5
    last, since, started = (-1, -1), time.monotonic(), time.monotonic()
    while time.monotonic() - started < timeout_s:
        state, now = _stored_chunks(kv_dir, chunk_bytes), time.monotonic()
        if state != last:
            last, since = state, now
        elif (state[0] >= expected and now - since >= quiet) or now - since >= settle_s:
            break
        time.sleep(0.25)
    return last[0]


@dataclass
class LiveRun:
    """What every phase of one run shares."""

    run: Path
    server: VLLMServer
    kv_dir: Path
    copy_dir: Path | None  # the write-only kvscope tier's directory, when the run has one
    device: str
    prompts: list[list[int]]
    expected_chunks: int
    chunk_bytes: int
    max_tokens: int
    observers: list[PhaseObserver]
    client_tracer: Any = None  # tracer.client.ClientTracer when tracing is on
    peer_copies: dict[str, Path] = field(default_factory=dict)  # chunk format -> directory


def wait_for_copy(live: "LiveRun") -> None:
    """Let the copying tiers finish their writes (none may run beside a cold phase, and the
    server's stop would lose them); record how many chunks each holds."""
    if live.copy_dir is not None:
        copied = wait_for_stores(live.copy_dir, live.expected_chunks, live.chunk_bytes)
        rundir.update_manifest(live.run, "copy", {"disk_path": str(live.copy_dir),
                                                  "chunks_on_disk": copied,
                                                  "chunks_expected": live.expected_chunks})
    if live.peer_copies:
        rundir.update_manifest(live.run, "peer_copies", {
            chunk_format: {"disk_path": str(directory), "chunks_expected": live.expected_chunks,
                           "chunks_on_disk": wait_for_stores(directory, live.expected_chunks,
                                                             live.chunk_bytes)}
            for chunk_format, directory in live.peer_copies.items()})


def record_ceiling(run: Path, kv_dir: Path, expected: int, chunk_bytes: int) -> None:
    """Measure the device ceiling on the stored chunks once, before the first cold phase."""
    wait_for_stores(kv_dir, expected, chunk_bytes)
    measured = ceiling.measure(kv_dir)
    rundir.update_manifest(run, "device_ceiling", measured.as_dict() if measured else None)


def run_phase(live: LiveRun, phase: Phase) -> dict:
    """Send every prompt once at the phase's concurrency; returns the phase's manifest entry."""
    run, server, device, prompt_ids = live.run, live.server, live.device, live.prompts
    stored = -1
    if phase.kind == "cold":
        stored = wait_for_stores(live.kv_dir, live.expected_chunks, live.chunk_bytes)
        system.drop_page_cache()
    records = [
        RequestRecord(request_id=f"{run.name}-{phase.label}-{i}", phase=phase.label,
                      concurrency=phase.concurrency, prompt_index=i,
                      trace_id="")
        for i in range(len(prompt_ids))
    ]
    plan = RequestPlan(server.base_url, server.config.served_name, live.max_tokens,
                       tracer=live.client_tracer)
    before, metrics_before = system.disk_counters(device), vllm_metrics.scrape(server)
    for observer in live.observers:
        observer.start_phase(run, phase.label, server)
    started = time.monotonic_ns()
    try:
        with tqdm(total=len(records), desc=f"{phase.label:>8} c={phase.concurrency}",
                  unit="req", leave=True) as bar:
            asyncio.run(run_requests(plan, prompt_ids, records, phase.concurrency,
                                     on_done=lambda r: bar.update(1)))
    finally:
        ended = time.monotonic_ns()
        for observer in reversed(live.observers):
            observer.stop_phase()
    after, metrics_after = system.disk_counters(device), vllm_metrics.scrape(server)
    rundir.append_table(run, "requests", pd.DataFrame([r.as_row() for r in records]))
    return {
        "name": phase.label, "kind": phase.kind, "concurrency": phase.concurrency,
        "started_ns": started, "ended_ns": ended, "page_cache_dropped": phase.kind == "cold",
        "chunks_on_disk": stored, "chunks_expected": live.expected_chunks,
        "disk_read_bytes": after.read_bytes - before.read_bytes,
        "disk_write_bytes": after.write_bytes - before.write_bytes,
        "num_requests": len(records),
        "num_errors": sum(r.status != "ok" for r in records),
        "vllm": vllm_metrics.delta(metrics_before, metrics_after),
    }


def _start_tracing(run: Path, opts: RunOptions, offset: clock.ClockOffset):
    """The run's tracer.run.RunTracing, or None (and manifest.tracer saying so) when off."""
    from kvscope.tracer import run as tracer_run

    if not opts.tracing:
        rundir.update_manifest(run, "tracer", tracer_run.disabled_summary())
        return None
    return tracer_run.RunTracing(run, offset.offset_ns)


def execute(opts: RunOptions, observers: list[PhaseObserver] | None = None) -> Path:
    """Validate, make the model twin (and the device twin `opts.device` names, unless the
    caller holds it), start the server, run every phase, always stop the server and the twin."""
    checked = validate(opts)
    if opts.twin is not None or device.twin_profile(opts.device) is None:
        return _execute(opts, checked, observers)
    with device.held(opts.device, DEFAULT_ROOT) as twin:
        return _execute(replace(opts, twin=twin), checked, observers)


def _execute(opts: RunOptions, checked: tuple[twins.TwinSpec, profiles.Profile, list[Phase]],
             observers: list[PhaseObserver] | None) -> Path:
    spec, profile, phases = checked
    model_dir, _ = twins.make(spec, opts.models_dir / spec.name)
    kv_dir_asked = opts.kv_dir
    if opts.twin is not None and kv_dir_asked is None:
        kv_dir_asked = Path(opts.twin.mountpoint) / f"kv-{opts.out.name}"
    kv = RunKVDir.prepare(kv_dir_asked, opts.out.name)
    kv_dir = kv.path
    system.check_writable_dir(kv_dir)
    copy = RunKVDir.prepare(opts.copy_kv_dir, opts.out.name) if opts.copy_kv_dir else None
    peer_copies = {f: RunKVDir.prepare(d, opts.out.name) for f, d in opts.peer_copies.items()}
    if profile.prepare is not None:
        profile.prepare(kv_dir)
    lmcache = profile.lmcache_config(kv_dir)
    if copy is not None:
        lmcache = profiles.with_kvscope_copy(lmcache, copy.path)
    lmcache = peers.with_copies(lmcache, {f: d.path for f, d in peer_copies.items()})
    offset = clock.measure_offset()
    run = rundir.create(opts.out, _manifest(opts, spec, profile, lmcache, kv_dir, model_dir,
                                            offset))
    tracing = _start_tracing(run, opts, offset)
    disk_backend = DiskBackendObserver(run)
    prompt_ids = prompts.make_prompts(opts.requests, opts.prompt_tokens, vocab_size=spec.vocab_size,
                                 seed=opts.seed, shared_prefix_tokens=opts.shared_prefix_tokens)
    config = ServerConfig(
        model_dir=model_dir, served_name=spec.name, port=opts.port, host=opts.host,
        max_model_len=opts.prompt_tokens + opts.max_tokens,
        kv_cache_gib=_kv_cache_gib(opts, spec), lmcache=lmcache,
        kv_transfer=profiles.KV_TRANSFER_CONFIG, log_path=run / rundir.SERVER_LOG,
        extra_env={env.ENV_CLOCK_OFFSET: str(offset.offset_ns), **disk_backend.server_env(),
                   **(tracing.server_env() if tracing else {}), **opts.extra_env},
    )
    done: list[dict] = []
    try:
        with VLLMServer(config) as server:
            rundir.update_manifest(run, "server", {
                "argv": config.argv(), "env": config.env(run / "lmcache.yaml"),
                "startup_s": round(server.startup_s, 2),
            })
            disk = host.whole_disk(kv_dir)
            watching = list(observers or [])
            if opts.probes:
                watching.insert(0, ProbeObserver(disk))
            watching.append(disk_backend)
            if tracing is not None:
                watching.append(tracing)
            live = LiveRun(run, server, kv_dir, copy.path if copy else None, disk,
                           prompt_ids, expected_chunks(prompt_ids), spec.kv_bytes_per_chunk,
                           opts.max_tokens, watching, tracing.client if tracing else None,
                           {f: d.path for f, d in peer_copies.items()})
            for index, phase in enumerate(phases):
                if phase.kind == "cold" and all(p.kind != "cold" for p in phases[:index]):
                    wait_for_copy(live)
                    record_ceiling(run, kv_dir, live.expected_chunks, live.chunk_bytes)
                done.append(run_phase(live, phase))
                rundir.update_manifest(run, "phases", done)
            if opts.keep_kv:
                # vLLM kills its worker at shutdown: writes still queued would be lost.
                wait_for_stores(kv_dir, live.expected_chunks, live.chunk_bytes)
                wait_for_copy(live)
    finally:
        if tracing is not None:
            tracing.close()
        if not opts.keep_kv:
            kv.cleanup()
            if copy is not None:
                copy.cleanup()
            for peer_copy in peer_copies.values():
                peer_copy.cleanup()
    return run
