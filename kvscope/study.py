"""The serial-vs-parallel study behind `kvscope demo`: one run per backend profile, each
analysed against one device ceiling per disk for the study. Reading the finished study (the
headline table, verdicts, targets, the peer comparison, study.md) is the readers' job
(analysis.study_*), so a dashboard or CI can read a study without the CLI.

One warm phase serves the whole study where it can (`plan`): the stock profile's server also
stores kvscope's chunk format through a write-only tier and every other persistent format (the
peers: LMCache's raw-block image, its fs connector's files) through a tier of its own listed after
stock's, and every other profile runs its cold phases in a new server on those files. Every run measures the ceiling before its first cold phase
and the study again after its last, and the best of all of them is the ceiling every run is
judged against (`record`). After the last run its disk is read once more, alternately idle and
with every CPU busy (`ceiling.measure_busy`): a live phase reads while the engine computes, and
on a VM busy vCPUs can slow the disk itself, so the ceiling scaled by that ratio is a second bar.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.capture import ceiling
from kvscope.capture.device_twin import Twin
from kvscope.contract import files, rundir
from kvscope.contract.ceiling import Ceiling, best_of
from kvscope.capture.workload import profiles
from kvscope.capture.workload.kvdir import DEFAULT_ROOT
from kvscope.capture.workload.options import RunOptions
from kvscope.capture.workload.runner import execute
from kvscope.study_options import StudyOptions


@dataclass(frozen=True)
class Step:
    """One run of the study: its profile, phases, chunk directory and whose warm it reuses."""

    profile: str
    phases: list[str]
    kv_dir: Path
    warm_from: str | None  # the earlier profile whose warm phase stored this run's chunks
    copy_dir: Path | None = None  # its warm phase also stores kvscope's chunk format there
    peer_copies: dict[str, Path] = field(default_factory=dict)  # and each peer format's there

    def dirs(self) -> set[Path]:
        return ({self.kv_dir} | ({self.copy_dir} if self.copy_dir else set())
                | set(self.peer_copies.values()))


def warm_group(profile: str) -> str | None:
    """A name shared by the profiles that can read each other's stored chunks, or None.

    Only a backend that finds its chunk files on disk when it starts can skip its own warm
    phase: the kvscope plugin rebuilds its index from them, and its read knobs (serial or
    parallel, read ahead) do not change what it writes. LMCache's stock disk backend keeps its
    index in memory only, so each stock profile warms in its own server. LMCache's raw-block
    tier (an index checkpointed into its image) and its fs connector (one file per chunk) find
    theirs too: their profiles name their format.
    """
    if (named := profiles.get(profile).chunk_format) is not None:
        return named
    config = profiles.get(profile).lmcache_config(Path("/nonexistent"))
    if config.get("storage_plugins") != ["kvscope"]:
        return None
    from kvscope.patched_backend.parallel_disk import chunkfile

    extra = config.get("extra_config") or {}
    return (f"{extra.get('storage_plugin.kvscope.module_path')}."
            f"{extra.get('storage_plugin.kvscope.class_name')} chunk format v{chunkfile.VERSION}")


def plan(opts: StudyOptions, twin: Twin | None = None) -> list[Step]:
    """The study's runs in order. With a stock profile (no warm group) and persistent ones, the
    first stock profile runs first and its warm phase also stores kvscope's format (a write-only
    tier: stock's own tier serves every stock hit) and each peer format (tiers LMCache asks
    after stock's); every profile of those warm groups then runs only its cold phases, each in
    a new server on those files (the page cache dropped before each). Otherwise the first
    profile of each warm group warms and the rest of it reuse its chunk files."""
    from kvscope.capture.workload import peers

    root = Path(twin.mountpoint) if twin is not None else DEFAULT_ROOT
    base = opts.kv_dir_base or root / f"kv-{opts.out.name}"
    groups = {p: warm_group(p) if opts.share_warm else None for p in opts.profiles}
    hosted = list(dict.fromkeys(g for g in groups.values() if g is not None))
    host = next((p for p, g in groups.items() if g is None), None) if hosted else None
    stored: dict[str, tuple[str, Path]] = {}  # warm group: (the profile that warms, where)
    steps = []
    if host is not None:
        kvscope_group = next((g for g in hosted if g not in peers.WRITERS), None)
        copy_dir = base / "kv-shared" if kvscope_group else None
        peer_copies = {g: base / f"kv-shared-{g}" for g in hosted if g in peers.WRITERS}
        steps.append(Step(host, ["warm", "cold"], base / f"kv-{host}", None, copy_dir,
                          peer_copies))
        if kvscope_group and copy_dir:
            stored[kvscope_group] = (host, copy_dir)
        stored.update({g: (host, d) for g, d in peer_copies.items()})
    for profile in (p for p in opts.profiles if p != host):
        group = groups[profile]
        if group in stored:
            source, kv_dir = stored[group]
            steps.append(Step(profile, ["cold"], kv_dir, source))
            continue
        steps.append(Step(profile, ["warm", "cold"], base / f"kv-{profile}", None))
        if group is not None:
            stored[group] = (profile, base / f"kv-{profile}")
    return steps


def run_study(opts: StudyOptions, twin: Twin | None = None) -> dict[str, Path]:
    """Run every profile, measure the ceiling again after each, give the study one ceiling per
    device, then analyse each run against it; returns {profile: run directory}. `twin`: the
    device twin `opts.device` names, which the caller holds up for the whole study."""
    from kvscope.analysis import outputs

    steps = plan(opts, twin)
    runs: dict[str, Path] = {}
    after: dict[str, Ceiling | None] = {}
    busy: dict[str, Any] | None = None
    try:
        for i, step in enumerate(steps):
            extra: dict = {"models_dir": opts.models_dir} if opts.models_dir else {}
            run = execute(RunOptions(
                out=opts.out / step.profile, model=opts.model, profile=step.profile,
                requests=opts.requests, concurrency=opts.concurrency,
                prompt_tokens=opts.prompt_tokens, port=opts.port, command=opts.command,
                phases=step.phases, kv_dir=step.kv_dir, copy_kv_dir=step.copy_dir,
                peer_copies=step.peer_copies, keep_kv=True, device=opts.device, twin=twin,
                **extra,
            ))
            runs[step.profile] = run
            after[step.profile] = ceiling.measure(step.kv_dir, when="after the last cold phase")
            if i == len(steps) - 1 and (last := after[step.profile]) is not None:
                busy = ceiling.measure_busy(step.kv_dir, last.unit, last.depth)
            later = set().union(*(s.dirs() for s in steps[i + 1:]))
            for done in step.dirs() - later:
                shutil.rmtree(done, ignore_errors=True)
    finally:
        for step in steps:
            for done in step.dirs():
                shutil.rmtree(done, ignore_errors=True)
        if opts.kv_dir_base is None:  # the study's own parent directory, now empty
            for parent in {s.kv_dir.parent for s in steps}:
                try:
                    parent.rmdir()
                except OSError:
                    pass
    runs = {p: runs[p] for p in opts.profiles if p in runs}  # the order asked for
    record(opts.out, runs, steps, after, busy)
    for run in runs.values():
        outputs.analyze(run)
    return runs


def device_ceilings(manifests: dict[str, dict], after: dict[str, Ceiling | None]
                    ) -> dict[str, Ceiling]:
    """One ceiling per disk: the best of every run's measurements on it (before the first cold
    phase, after the last), every measurement kept in its samples."""
    by_device: dict[str, list] = {}
    for profile, manifest in manifests.items():
        device = str(manifest.get("machine", {}).get("disk_device") or "?")
        by_device.setdefault(device, []).extend(
            m for m in (manifest.get("device_ceiling"), after.get(profile)) if m)
    return {device: best for device, taken in by_device.items()
            if (best := best_of(taken)) is not None}


def record(study: Path, runs: dict[str, Path], steps: list[Step],
           after: dict[str, Ceiling | None], busy: dict[str, Any] | None = None) -> dict:
    """Write the study's section into every run's manifest, and study.json beside them.

    `busy`: the disk's rate with every CPU busy over idle (ceiling.measure_busy), measured on
    the last run's disk, so it is kept for that disk only."""
    manifests = {p: rundir.read_manifest(r) for p, r in runs.items()}
    ceilings = device_ceilings(manifests, after)
    warm_from = {s.profile: s.warm_from for s in steps}

    def device_of(profile: str) -> str:
        return str(manifests[profile].get("machine", {}).get("disk_device") or "?")

    busy_device = device_of(steps[-1].profile) if busy and steps[-1].profile in runs else None
    body = {"profiles": list(runs), "runs": {p: str(r) for p, r in runs.items()},
            "warm_phase_from": warm_from,
            "device_ceilings": {d: c.as_dict() for d, c in ceilings.items()},
            "device_busy_ratios": {busy_device: busy} if busy_device else {}}
    for profile, run in runs.items():
        device = device_of(profile)
        rundir.update_manifest(run, "study", {
            "dir": str(study), "profiles": list(runs), "warm_phase_from": warm_from[profile],
            "device_ceiling": ceilings[device].as_dict() if device in ceilings else None,
            "device_busy_ratio": busy if device == busy_device else None})
    files.atomic_write(study / "study.json", json.dumps(body, indent=2), files.OUTPUT_FILE_MODE)
    return body
