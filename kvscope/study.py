"""The serial-vs-parallel study behind `kvscope demo`: `repeats` runs per backend profile, in
interleaved blocks (every profile once per block, the blocks in ABBA or seeded random order), so
that a drift of the shared machine weighs on every profile alike and each ratio gets an interval
across repetitions (analysis.replicates); every run is analysed against one device ceiling per
disk for the study. Reading the finished study (the headline table, verdicts, targets, the
peer comparison, study.md) is the readers' job (analysis.study_*), so a dashboard or CI can read
a study without the CLI.

One warm phase serves the whole study where it can (`plan`): the stock profile's server also
stores kvscope's chunk format through a write-only tier and every other persistent format (the
peers: LMCache's raw-block image, its fs connector's files) through a tier of its own listed after
stock's, and every other profile runs its cold phases in a new server on those files; later
repetitions read the same files again (stock, whose index lives in memory, warms each time).
Every run measures the ceiling before its first cold phase and the study again after its last,
and the best of all of them is the ceiling every run is judged against (`record`). After the last run its disk is read once more, alternately idle and
with every CPU busy (`ceiling.measure_busy`): a live phase reads while the engine computes, and
on a VM busy vCPUs can slow the disk itself, so the ceiling scaled by that ratio is a second bar.
"""

from __future__ import annotations

import json
import random
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
from kvscope.study_options import ORDERS, StudyOptions


@dataclass(frozen=True)
class Step:
    """One run of the study: its profile, phases, chunk directory and whose warm it reuses."""

    profile: str
    phases: list[str]
    kv_dir: Path
    warm_from: str | None  # the earlier profile whose warm phase stored this run's chunks
    copy_dir: Path | None = None  # its warm phase also stores kvscope's chunk format there
    peer_copies: dict[str, Path] = field(default_factory=dict)  # and each peer format's there
    rep: int = 1  # which repetition (block) of the study

    @property
    def name(self) -> str:
        """The run directory's name in the study: profile and repetition."""
        return f"{self.profile}-r{self.rep}"

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
    """The study's runs in order: `opts.repeats` blocks, each running every profile once
    (block_orders). The first block is one repetition as below; later blocks read the chunk
    files the first stored (`again`).

    With a stock profile (no warm group) and persistent ones, the first stock profile runs
    first and its warm phase also stores kvscope's format (a write-only tier: stock's own tier
    serves every stock hit) and each peer format (tiers LMCache asks after stock's); every
    profile of those warm groups then runs only its cold phases, each in a new server on those
    files (the page cache dropped before each). Otherwise the first profile of each warm group
    warms and the rest of it reuse its chunk files."""
    root = Path(twin.mountpoint) if twin is not None else DEFAULT_ROOT
    base = opts.kv_dir_base or root / f"kv-{opts.out.name}"
    groups = {p: warm_group(p) if opts.share_warm else None for p in opts.profiles}
    rng = random.Random(opts.seed)
    asked = rng.sample(opts.profiles, len(opts.profiles)) if opts.order == "random" \
        else opts.profiles
    first = _one_repetition(asked, groups, base)
    by_profile = {s.profile: s for s in first}
    blocks = block_orders([s.profile for s in first], opts.repeats, opts.order, rng)
    return first + [again(by_profile[p], groups[p], rep, base)
                    for rep, block in enumerate(blocks[1:], start=2) for p in block]


def block_orders(first: list[str], repeats: int, order: str,
                 rng: random.Random) -> list[list[str]]:
    """Each repetition's run order, every profile once per block. `abba`: each block reverses
    the one before (A B C, C B A, A B C, ...), so a drift of the shared machine over the study
    falls on every profile from both sides (exactly balanced for an even number of blocks);
    `random`: each block after the first is a permutation drawn from `rng` (the seeded
    generator that ordered the first). The first block stays `first`: its host warms first."""
    if order not in ORDERS or repeats < 1:
        raise ValueError(f"study order must be one of {list(ORDERS)} (got {order!r}) and "
                         f"repeats at least 1 (got {repeats})")
    if order == "abba":
        return [first if k % 2 == 0 else first[::-1] for k in range(repeats)]
    return [first] + [rng.sample(first, len(first)) for _ in range(repeats - 1)]


def again(first: Step, group: str | None, rep: int, base: Path) -> Step:
    """A later repetition of a profile's first run. A profile that read another's stored
    chunks, or stored chunks others read (a warm group's), runs cold only on those files: they
    stay on disk until the study's last reader. One with no warm group (stock: its index lives
    in its server's memory) warms again in a new server, in a directory of its own."""
    if first.warm_from is not None:
        return Step(first.profile, ["cold"], first.kv_dir, first.warm_from, rep=rep)
    if group is not None:
        return Step(first.profile, ["cold"], first.kv_dir, first.profile, rep=rep)
    return Step(first.profile, ["warm", "cold"], base / f"kv-{first.profile}-r{rep}", None,
                rep=rep)


def _one_repetition(profiles: list[str], groups: dict[str, str | None],
                    base: Path) -> list[Step]:
    """The first block (plan's docstring says how the warm phases are shared)."""
    from kvscope.capture.workload import peers

    hosted = list(dict.fromkeys(groups[p] for p in profiles if groups[p] is not None))
    host = next((p for p in profiles if groups[p] is None), None) if hosted else None
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
    for profile in (p for p in profiles if p != host):
        group = groups[profile]
        if group in stored:
            source, kv_dir = stored[group]
            steps.append(Step(profile, ["cold"], kv_dir, source))
            continue
        steps.append(Step(profile, ["warm", "cold"], base / f"kv-{profile}", None))
        if group is not None:
            stored[group] = (profile, base / f"kv-{profile}")
    return steps


def run_study(opts: StudyOptions, twin: Twin | None = None) -> list[dict[str, Path]]:
    """Run every step of the plan, measure the ceiling again after each, give the study one
    ceiling per device, then analyse each run against it; returns one {profile: run directory}
    per repetition. `twin`: the device twin `opts.device` names, which the caller holds up for
    the whole study."""
    from kvscope.analysis import outputs

    steps = plan(opts, twin)
    made: list[tuple[Step, Path, Ceiling | None]] = []
    busy: dict[str, Any] | None = None
    try:
        for i, step in enumerate(steps):
            extra: dict = {"models_dir": opts.models_dir} if opts.models_dir else {}
            run = execute(RunOptions(
                out=opts.out / step.name, model=opts.model, profile=step.profile,
                requests=opts.requests, concurrency=opts.concurrency,
                prompt_tokens=opts.prompt_tokens, port=opts.port, command=opts.command,
                phases=step.phases, kv_dir=step.kv_dir, copy_kv_dir=step.copy_dir,
                peer_copies=step.peer_copies, keep_kv=True, device=opts.device, twin=twin,
                **extra,
            ))
            after = ceiling.measure(step.kv_dir, when="after the last cold phase")
            made.append((step, run, after))
            if i == len(steps) - 1 and after is not None:
                busy = ceiling.measure_busy(step.kv_dir, after.unit, after.depth)
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
    record(opts, made, busy)
    reps = repetitions(opts.profiles, made)
    for runs in reps:
        for run in runs.values():
            outputs.analyze(run)
    return reps


def repetitions(profiles: list[str], made: list[tuple[Step, Path, Any]]
                ) -> list[dict[str, Path]]:
    """One {profile: run} per repetition, profiles in the order asked for (not the run order)."""
    count = max((step.rep for step, _, _ in made), default=0)
    runs = {(step.profile, step.rep): run for step, run, _ in made}
    return [{p: runs[(p, rep)] for p in profiles if (p, rep) in runs}
            for rep in range(1, count + 1)]


def device_ceilings(manifests: list[dict], after: list[Ceiling | None]) -> dict[str, Ceiling]:
    """One ceiling per disk: the best of every run's measurements on it (before the first cold
    phase, after the last), every measurement kept in its samples. `after`: each run's, in the
    order of `manifests`."""
    by_device: dict[str, list] = {}
    for manifest, measured in zip(manifests, after):
        device = str(manifest.get("machine", {}).get("disk_device") or "?")
        by_device.setdefault(device, []).extend(
            m for m in (manifest.get("device_ceiling"), measured) if m)
    return {device: best for device, taken in by_device.items()
            if (best := best_of(taken)) is not None}


def record(opts: StudyOptions, made: list[tuple[Step, Path, Ceiling | None]],
           busy: dict[str, Any] | None = None) -> dict:
    """Write the study's section into every run's manifest, and study.json beside them: the
    runs in the order they ran (each its step, run directory and the ceiling measured after
    it), with the order's kind and seed, so the interleaving can be checked and redone.

    `busy`: the disk's rate with every CPU busy over idle (ceiling.measure_busy), measured on
    the last run's disk, so it is kept for that disk only."""
    manifests = [rundir.read_manifest(run) for _, run, _ in made]
    ceilings = device_ceilings(manifests, [after for _, _, after in made])
    devices = [str(m.get("machine", {}).get("disk_device") or "?") for m in manifests]
    busy_device = devices[-1] if busy and made else None
    reps = repetitions(opts.profiles, made)
    body = {"profiles": list(reps[0]) if reps else [], "repetitions": len(reps),
            "order": opts.order, "seed": opts.seed,
            "runs": [{p: str(r) for p, r in runs.items()} for runs in reps],
            "run_order": [{"profile": s.profile, "repetition": s.rep, "run": str(r),
                           "warm_phase_from": s.warm_from} for s, r, _ in made],
            "device_ceilings": {d: c.as_dict() for d, c in ceilings.items()},
            "device_busy_ratios": {busy_device: busy} if busy_device else {}}
    for position, ((step, run, _), device) in enumerate(zip(made, devices)):
        rundir.update_manifest(run, "study", {
            "dir": str(opts.out), "profiles": body["profiles"], "repetition": step.rep,
            "repetitions": len(reps), "position": position, "warm_phase_from": step.warm_from,
            "device_ceiling": ceilings[device].as_dict() if device in ceilings else None,
            "device_busy_ratio": busy if device == busy_device else None})
    files.atomic_write(opts.out / "study.json", json.dumps(body, indent=2),
                       files.OUTPUT_FILE_MODE)
    return body
