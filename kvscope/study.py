"""The serial-vs-parallel study behind `kvscope demo`: one run per backend profile, analysed,
compared, and summed up in a headline table beside one device ceiling per disk for the study.

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
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvscope.capture import ceiling
from kvscope.contract import files, rundir
from kvscope.capture.workload import profiles
from kvscope.capture.workload.options import RunOptions
from kvscope.capture.workload.runner import execute
from kvscope.study_options import BASELINE, CANDIDATE, CLASSIC, StudyOptions

CEILING_BOUND = 0.8  # reads at or above this share of the ceiling: the device limits the gain
MINOR_SHARE = 0.2  # storage reads below this share of TTFT cannot limit the gain much


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


def plan(opts: StudyOptions) -> list[Step]:
    """The study's runs in order. With a stock profile (no warm group) and persistent ones, the
    first stock profile runs first and its warm phase also stores kvscope's format (a write-only
    tier: stock's own tier serves every stock hit) and each peer format (tiers LMCache asks
    after stock's); every profile of those warm groups then runs only its cold phases, each in
    a new server on those files (the page cache dropped before each). Otherwise the first
    profile of each warm group warms and the rest of it reuse its chunk files."""
    from kvscope.capture.workload import peers

    base = opts.kv_dir_base or Path("/var/tmp/kvscope") / f"kv-{opts.out.name}"
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


def run_study(opts: StudyOptions) -> dict[str, Path]:
    """Run every profile, measure the ceiling again after each, give the study one ceiling per
    device, then analyse each run against it; returns {profile: run directory}."""
    from kvscope.analysis import outputs

    steps = plan(opts)
    runs: dict[str, Path] = {}
    after: dict[str, ceiling.Ceiling | None] = {}
    busy: dict[str, Any] | None = None
    try:
        for i, step in enumerate(steps):
            extra: dict = {"models_dir": opts.models_dir} if opts.models_dir else {}
            run = execute(RunOptions(
                out=opts.out / step.profile, model=opts.model, profile=step.profile,
                requests=opts.requests, concurrency=opts.concurrency,
                prompt_tokens=opts.prompt_tokens, port=opts.port, command=opts.command,
                phases=step.phases, kv_dir=step.kv_dir, copy_kv_dir=step.copy_dir,
                peer_copies=step.peer_copies, keep_kv=True, **extra,
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


def device_ceilings(manifests: dict[str, dict], after: dict[str, ceiling.Ceiling | None]
                    ) -> dict[str, ceiling.Ceiling]:
    """One ceiling per disk: the best of every run's measurements on it (before the first cold
    phase, after the last), every measurement kept in its samples."""
    by_device: dict[str, list] = {}
    for profile, manifest in manifests.items():
        device = str(manifest.get("machine", {}).get("disk_device") or "?")
        by_device.setdefault(device, []).extend(
            m for m in (manifest.get("device_ceiling"), after.get(profile)) if m)
    return {device: best for device, taken in by_device.items()
            if (best := ceiling.best_of(taken)) is not None}


def record(study: Path, runs: dict[str, Path], steps: list[Step],
           after: dict[str, ceiling.Ceiling | None], busy: dict[str, Any] | None = None) -> dict:
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


def _seconds(group: dict, component: str, stat: str) -> float:
    return group["percentiles_ns"].get(component, {}).get(stat, math.nan) / 1e9


def _read_rates(summary: dict, phase: str) -> tuple[float, float]:
    """(bytes/s while a read was in flight, share of the phase's read span the disk was busy),
    as the run's findings say them (analysis.findings.phase_reads)."""
    from kvscope.analysis.findings import phase_reads

    reads = phase_reads(summary, phase)
    if reads is None or reads["busy_share"] is None:
        return math.nan, math.nan
    return reads["busy_bytes_per_s"], reads["busy_share"]


def _phase_row(summary: dict, key: str, phase: str) -> dict:
    return next((r for r in summary.get(key, []) if r["phase"] == phase), {})


def headline(runs: dict[str, Path]) -> pd.DataFrame:
    """Per profile and cold phase: TTFT and component percentiles, throughput, read rate
    against the study's one ceiling for the disk (capped at 1: above it, `ceiling_under_by`)."""
    from kvscope.analysis.findings import ceiling_of

    rows = []
    for profile, run in runs.items():
        summary = json.loads((run / "summary.json").read_text())
        manifest = rundir.read_manifest(run)
        best = ceiling_of(manifest).get("bytes_per_s") or math.nan
        busy_ratio = ((manifest.get("study") or {}).get("device_busy_ratio") or {}).get(
            "ratio") or math.nan
        for group in summary["groups"]:
            if not group["phase"].startswith("cold"):
                continue
            rate, busy = _read_rates(summary, group["phase"])
            rates = _phase_row(summary, "throughput", group["phase"])
            rows.append({
                "profile": profile, "phase": group["phase"], "conc": group["concurrency"],
                "ttft_p50_s": _seconds(group, "ttft", "p50"),
                "ttft_p99_s": _seconds(group, "ttft", "p99"),
                **{f"{c}_p50_s": _seconds(group, c, "p50")
                   for c in ("queueing", "kv_lookup", "storage_read", "transfer", "prefill", "other")},
                "read_GBps": rate / 1e9,
                "ceiling_GBps": best / 1e9,
                "read_vs_ceiling": min(rate / best, 1.0),
                "ceiling_under_by": max(rate / best - 1, 0.0),
                "read_vs_busy_ceiling": min(rate / (best * busy_ratio), 1.0),
                "disk_busy_share": busy,
                "in_flight": _phase_row(summary, "queue_depth_by_phase", group["phase"]).get(
                    "mean", math.nan),
                "req_per_s": rates.get("requests_per_s") or math.nan,
                "storage_tok_per_s": rates.get("storage_tokens_per_s") or math.nan,
                "out_tok_per_s": rates.get("output_tokens_per_s") or math.nan,
            })
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    base = table[table["profile"] == BASELINE].set_index("conc")
    table["speedup_vs_serial"] = base["ttft_p50_s"].reindex(table["conc"]).to_numpy() / table["ttft_p50_s"]
    table["throughput_vs_serial"] = table["req_per_s"] / base["req_per_s"].reindex(table["conc"]).to_numpy()
    table["bound"] = [bound(row) for row in table.itertuples()]
    return table


def verdict(table: pd.DataFrame, runs: dict[str, Path] | None = None) -> list[str]:
    """What limits the gain, in numbers, per concurrency level of the parallel path; with the
    runs, each line ends with where that phase's read bandwidth went (analysis.readpath)."""
    return [_limit(row) + _where_reads_went(runs, str(row.phase))
            for row in table[table["profile"] == CANDIDATE].itertuples()]


def _where_reads_went(runs: dict[str, Path] | None, phase: str) -> str:
    from kvscope.analysis import readpath

    if not runs or CANDIDATE not in runs:
        return ""
    summary = json.loads((runs[CANDIDATE] / "summary.json").read_text())
    row = _phase_row(summary, "read_path", phase)
    return f". Read path: {readpath.words(row)}" if row else ""


def _limit(row) -> str:
    """The verdict for one row of the parallel path."""
    share = row.read_vs_ceiling
    read_share = row.storage_read_p50_s / row.ttft_p50_s if row.ttft_p50_s else math.nan
    gain = (f"speedup over serial {row.speedup_vs_serial:.2f}x, throughput "
            f"{row.throughput_vs_serial:.2f}x")
    if read_share < MINOR_SHARE:
        return (f"c={row.conc}: storage reads are only {read_share:.0%} of TTFT "
                f"({row.storage_read_p50_s * 1e3:.1f} of {row.ttft_p50_s * 1e3:.1f} ms p50), so the "
                f"read path barely moves TTFT here (prefill {row.prefill_p50_s * 1e3:.1f} ms, "
                f"other {row.other_p50_s * 1e3:.1f} ms); {gain}")
    if math.isnan(share):
        return f"c={row.conc}: no device ceiling or block reads recorded; no verdict"
    if row.ceiling_under_by > 0:
        return (f"c={row.conc}: reads ran at {row.read_GBps:.2f} GB/s, faster than the "
                f"{row.ceiling_GBps:.2f} GB/s the study measured for this disk: the ceiling was "
                f"under-measured by at least {row.ceiling_under_by:.0%}, so no verdict on the "
                f"device from it; {gain}")
    if share >= CEILING_BOUND:
        return (f"c={row.conc}: while reading, the device limits the gain: parallel reads ran at "
                f"{row.read_GBps:.2f} GB/s, {share:.0%} of the {row.ceiling_GBps:.2f} GB/s "
                f"ceiling of this disk (best of the study's measurements); the disk was busy "
                f"{row.disk_busy_share:.0%} of the phase's read span and waited on the rest of "
                f"the path (copies, prefill, the next request) the rest of the time; {gain}")
    return (f"c={row.conc}: the read path, not the device, limits the gain: "
            f"{row.read_GBps:.2f} GB/s is {share:.0%} of the {row.ceiling_GBps:.2f} GB/s ceiling "
            f"while reading (disk busy {row.disk_busy_share:.0%} of the read span, "
            f"{row.in_flight:.1f} requests in flight on average); {gain}")


def comparisons(runs: dict[str, Path]) -> pd.DataFrame:
    """Serial vs parallel per cold phase: TTFT and storage-read speedups with 95 % CIs."""
    from kvscope.analysis import compare, outputs

    if BASELINE not in runs or CANDIDATE not in runs:
        return pd.DataFrame()
    a, b = outputs.load_attribution(runs[BASELINE]), outputs.load_attribution(runs[CANDIDATE])
    rows = []
    for phase in sorted(set(a["phase"]) & set(b["phase"])):
        if not phase.startswith("cold"):
            continue
        table = compare.compare(a, b, phase=phase).set_index("component")
        for part in ("ttft", "storage_read"):
            r = table.loc[part]
            rows.append({"phase": phase, "component": part, "serial_p50_s": r.a_s,
                         "parallel_p50_s": r.b_s, "speedup": r.speedup,
                         "ci95": f"[{r.speedup_lo:.2f}, {r.speedup_hi:.2f}]"})
    return pd.DataFrame(rows)


def throughput_comparisons(runs: dict[str, Path]) -> pd.DataFrame:
    """Parallel over serial throughput per cold phase and metric, with 95 % bootstrap CIs."""
    from kvscope.analysis import throughput

    if BASELINE not in runs or CANDIDATE not in runs:
        return pd.DataFrame()
    a, b = (rundir.read_table(runs[p], "requests") for p in (BASELINE, CANDIDATE))
    if a is None or b is None:
        return pd.DataFrame()
    frames = [throughput.ratio(a, b, phase)
              for phase in sorted(set(a["phase"]) & set(b["phase"])) if phase.startswith("cold")]
    if not frames:
        return pd.DataFrame()
    table = pd.concat(frames, ignore_index=True).rename(columns={"a": "serial", "b": "parallel"})
    table["ci95"] = [f"[{lo:.2f}, {hi:.2f}]" for lo, hi in zip(table["ratio_lo"], table["ratio_hi"])]
    return table.drop(columns=["ratio_lo", "ratio_hi"])


def ceiling_lines(runs: dict[str, Path]) -> list[str]:
    """The study's ceiling per disk, how it was found and how much its measurements spread."""
    seen, lines = set(), []
    for run in runs.values():
        manifest = rundir.read_manifest(run)
        study = manifest.get("study") or {}
        measured = study.get("device_ceiling")
        device = manifest.get("machine", {}).get("disk_device", "?")
        if not measured or device in seen:
            continue
        seen.add(device)
        c = ceiling.best_of([measured])  # fills samples and spread for a single measurement
        if c is None:
            continue
        rates = sorted(x["bytes_per_s"] / 1e9 for x in c.samples)
        lines.append(
            f"- `{device}`: {c.bytes_per_s / 1e9:.2f} GB/s, the best of {len(rates)} "
            f"measurements ({c.method}, {c.unit >> 20} MiB x {c.depth} in flight, "
            f"{c.when or 'when not recorded'}); all: {', '.join(f'{r:.2f}' for r in rates)} "
            f"GB/s; the best configuration's repeats spread {c.spread:.0%}. Every run of the "
            "study is judged against it.")
    return lines


# Issue 24's end-to-end targets at c = 8 and 16: read rate while reading, disk busy share of the
# read span, TTFT p50 over (bytes the request waited for / ceiling + its own prefill).
TARGET_READ, TARGET_BUSY, TARGET_TTFT = 0.95, 0.90, 1.2


def ideal_ttft_ratio(run: Path, phase: str, ceiling_bytes_per_s: float) -> float:
    """TTFT p50 over the p50 of each request's floor: the KV bytes of every request whose first
    token came no later than its own (the worker loads a step's requests before its forward),
    read at the ceiling, plus its own prefill (without other requests' prefill in its batch)."""
    from kvscope.analysis import outputs

    requests = rundir.read_table(run, "requests")
    if requests is None:
        return math.nan
    requests = requests[(requests["phase"] == phase) & (requests["status"] == "ok")]
    if requests.empty or not ceiling_bytes_per_s:
        return math.nan
    per_token = rundir.read_manifest(run)["model"]["kv_bytes_per_token"]
    attribution = outputs.load_attribution(run).set_index("request_id")
    own_prefill = (attribution["prefill_ns"] - attribution.get("batch_prefill_ns", 0)) / 1e9
    first = requests["first_token_ns"].to_numpy()
    kv = requests["cached_tokens"].to_numpy() * per_token
    floors = [kv[first <= f].sum() / ceiling_bytes_per_s
              + float(own_prefill.get(rid, 0.0)) for rid, f in
              zip(requests["request_id"].astype(str), first)]
    return float(requests["ttft_s"].median() / pd.Series(floors).median())


def target_rows(runs: dict[str, Path], table: pd.DataFrame) -> pd.DataFrame:
    """Issue 24's targets at c = 8 and 16 for the new path and the one before it, one run."""
    rows = []
    for row in table[table["profile"].isin([CLASSIC, CANDIDATE])].to_dict("records"):
        if row["conc"] not in (8, 16):
            continue
        ttft = ideal_ttft_ratio(runs[row["profile"]], row["phase"], row["ceiling_GBps"] * 1e9)
        rows.append({
            "profile": row["profile"], "phase": row["phase"], "conc": row["conc"],
            "ttft_p50_s": row["ttft_p50_s"],
            "read_vs_ceiling": row["read_vs_ceiling"],
            "read_vs_busy_ceiling": row["read_vs_busy_ceiling"],
            "disk_busy_share": row["disk_busy_share"],
            "ttft_vs_floor": ttft,
            "met": ", ".join(name for name, ok in (
                ("read", row["read_vs_ceiling"] >= TARGET_READ),
                ("busy", row["disk_busy_share"] >= TARGET_BUSY),
                ("ttft", ttft <= TARGET_TTFT)) if ok) or "none"})
    return pd.DataFrame(rows)


def target_reasons(runs: dict[str, Path], targets: pd.DataFrame) -> list[str]:
    """Why each row missed what it missed, from its run's own analysis: a target's ratio alone
    does not say what to change (more readers, earlier reads, or nothing a read path can do)."""
    from kvscope.analysis import outputs

    lines = []
    for row in targets.to_dict("records"):
        run, phase = runs[row["profile"]], row["phase"]
        reads = _phase_row(json.loads((run / "summary.json").read_text()), "read_path", phase)
        attribution = outputs.load_attribution(run)
        p50 = attribution[attribution["phase"] == phase].filter(like="_ns").median() / 1e9
        why = []
        if row["read_vs_ceiling"] < TARGET_READ and reads:
            why.append(_read_reason(row["read_vs_ceiling"], row["read_vs_busy_ceiling"], reads))
        if row["disk_busy_share"] < TARGET_BUSY and reads:
            asked = reads["read_span_s"] - reads["idle_unasked_s"]
            why.append(f"busy {row['disk_busy_share']:.0%}: the disk was idle "
                       f"{reads['idle_s']:.2f} s of the {reads['read_span_s']:.2f} s read span, "
                       f"{reads['idle_unasked_s']:.2f} s of it with no request waiting for its "
                       f"reads (busy {reads['busy_s'] / asked:.0%} of the rest), "
                       f"{reads['idle_transfer_s']:.2f} s while the worker copied loaded chunks, "
                       f"{reads['idle_prefill_s']:.2f} s while it prefilled")
        if row["ttft_vs_floor"] > TARGET_TTFT and not p50.empty:
            why.append(
                f"TTFT {row['ttft_vs_floor']:.2f}x the floor ({row['ttft_p50_s']:.2f} s against "
                f"{row['ttft_p50_s'] / row['ttft_vs_floor']:.2f} s); p50s of its parts: storage "
                f"read {p50['storage_read_ns']:.2f} s ({p50['batch_storage_read_ns']:.2f} s of "
                f"it other requests' loads) at {row['read_vs_ceiling']:.2f}x the ceiling, "
                f"transfer {p50['transfer_ns']:.2f} s ({p50['batch_transfer_ns']:.2f} s other "
                f"requests' copies), prefill {p50['prefill_ns']:.2f} s "
                f"({p50['batch_prefill_ns']:.2f} s other requests'), other "
                f"{p50['other_ns']:.2f} s; the floor counts only the reads at the ceiling and "
                "the request's own prefill")
        if why:
            lines.append(f"{row['profile']} c={row['conc']}: " + "; ".join(why))
    return lines


def _read_reason(share: float, busy_share: float, reads: dict) -> str:
    from kvscope.analysis import readpath

    text = f"read {share:.2f}x the ceiling while reading"
    if not math.isnan(busy_share):
        text += (f" ({busy_share:.2f}x the ceiling scaled to what the disk gave with every CPU "
                 "busy)")
    if reads["in_flight_while_busy"] is None:
        return text
    text += (f": {reads['in_flight_while_busy']:.0f} reads in flight, "
             f"{reads['at_device_while_busy']:.0f} of them at the device, each "
             f"{reads['io_p50_ms']:.1f} ms there (p50)")
    if reads["reader_gap_p50_ms"] is not None:
        text += (f", and each of {reads['readers']} readers {reads['reader_gap_p50_ms']:.1f} ms "
                 f"(p50) between its reads ({readpath.GAP_CAUSES})")
    return text


def knob_lines(runs: dict[str, Path]) -> list[str]:
    """The read knobs each kvscope run served with: chosen at start (tune auto) or as set."""
    from kvscope.contract.counters import READ_KNOBS_KEY

    lines = []
    for profile, run in runs.items():
        knobs = (rundir.read_manifest(run).get("disk_backend") or {}).get(READ_KNOBS_KEY) or {}
        if not knobs.get("queue_depth"):
            continue
        how = "chosen at start by tune auto" if knobs.get("tune") == "auto" else "as set"
        unit = int(knobs.get("read_unit") or 0)
        lines.append(
            f"- `{profile}` ({knobs.get('mode')}): read unit "
            + (f"{unit / 2**20:g} MiB" if unit else "one read per chunk")
            + f", {knobs.get('queue_depth')} readers, "
            f"{int(knobs.get('max_inflight_bytes') or 0) / 2**20:g} MiB in flight, {how}; "
            + ("each chunk copied as soon as it is read" if knobs.get("pipeline_transfer")
               else "a request's chunks copied after all of them are read"))
    return lines


def warm_lines(runs: dict[str, Path]) -> list[str]:
    lines = []
    for profile, run in runs.items():
        source = (rundir.read_manifest(run).get("study") or {}).get("warm_phase_from")
        if not source:
            continue
        host = rundir.read_manifest(runs[source]) if source in runs else {}
        fmt = warm_group(profile)
        if fmt in (host.get("peer_copies") or {}):
            copies = host["peer_copies"][fmt]
            how = (f"by a `{fmt}` tier LMCache asked after its own, which served every one of "
                   f"its hits ({copies['chunks_on_disk']} of {copies['chunks_expected']} chunks "
                   "stored)")
        elif host.get("copy"):
            how = ("by a write-only kvscope tier beside its own, which served every one of its "
                   "hits")
        else:
            how = "(same chunk format)"
        lines.append(f"- `{profile}` read the chunk files stored in the warm phase of "
                     f"`{source}` {how}; a new server, page cache dropped before each cold phase")
    return lines


def write_report(study: Path, runs: dict[str, Path], table: pd.DataFrame) -> Path:
    """study.md: the headline table, the verdict, the comparisons and links to each run."""
    first = rundir.read_manifest(next(iter(runs.values())))
    model, workload = first["model"], first["workload"]
    lines = [
        f"# kvscope study: {' vs '.join(runs)}", "",
        f"Model twin `{model['twin']}` ({model['kv_bytes_per_token'] / 1024:g} KiB of KV per token, "
        f"{model['kv_bytes_per_chunk'] / 2**20:g} MiB per chunk); {workload['num_requests']} prompts of "
        f"{workload['prompt_tokens']} tokens; cold phases at concurrency "
        f"{', '.join(map(str, workload['concurrency']))}; machine {first['machine']['hostname']} "
        f"({first['machine']['cpus']} CPUs, disk {first['machine']['disk_device']}).", "",
        "## Headline (cold phases; seconds, GB/s, per second)", "",
        table.to_markdown(index=False, floatfmt=".3f"), "",
        "## Device ceiling (one per disk)", "", *ceiling_lines(runs), "",
        "## Read knobs", "", *knob_lines(runs), "",
        "## What limits the gain", "", *[f"- {line}" for line in verdict(table, runs)], "",
    ]
    targets = target_rows(runs, table)
    if not targets.empty:
        lines += [f"## Targets at c = 8 and 16, new path beside the one before it (read >= "
                  f"{TARGET_READ}x ceiling, disk busy >= {TARGET_BUSY:.0%} of the read span, "
                  f"TTFT p50 <= {TARGET_TTFT}x the floor: bytes waited for / ceiling + own "
                  "prefill)", "", targets.to_markdown(index=False, floatfmt=".3f"), "",
                  *[f"- {line}" for line in target_reasons(runs, targets)], ""]
    if warm := warm_lines(runs):
        lines += ["## Warm phases", "", *warm, ""]
    compared = comparisons(runs)
    if not compared.empty:
        lines += ["## Serial vs parallel (p50, 95 % bootstrap CI of the speedup)", "",
                  compared.to_markdown(index=False, floatfmt=".3f"), ""]
    rates = throughput_comparisons(runs)
    if not rates.empty:
        lines += ["## Throughput, parallel / serial (95 % bootstrap CI of the ratio)", "",
                  rates.to_markdown(index=False, floatfmt=".3f"), ""]
    peers = peer_comparisons(runs)
    if not peers.empty:
        lines += ["## kvscope against the other disk paths", "",
                  "Ratios other / kvscope for TTFT p50 and kvscope / other for requests/s (> 1: "
                  "kvscope ahead), 95 % bootstrap CIs; what limits each side from its "
                  "attribution and block I/O.", "",
                  peer_table(peers).to_markdown(index=False, floatfmt=".3f"), "",
                  *[f"- {line}" for line in peer_verdicts(table, peers)], ""]
    lines += ["## Runs", ""] + [f"- `{p}`: [{r.name}/report.md]({r.name}/report.md)"
                                for p, r in runs.items()]
    report = study / "study.md"
    files.atomic_write(report, "\n".join(lines) + "\n", files.OUTPUT_FILE_MODE)
    return report


# -- kvscope against LMCache's other disk paths (the peers) --------------------------------
DEVICE_BOUND, READ_PATH_BOUND, CPU_BOUND = "device-bound", "read-path-bound", "CPU-bound"


def bound(row) -> str:
    """What limits one profile's cold phase, from its attribution and block I/O: CPU-bound when
    storage reads are a minor share of TTFT (prefill, copies and the rest dominate);
    device-bound when reads ran near the ceiling and the disk was busy most of the read span;
    read-path-bound otherwise (the path left the disk idle or below its ceiling)."""
    read_share = row.storage_read_p50_s / row.ttft_p50_s if row.ttft_p50_s else math.nan
    if read_share < MINOR_SHARE:
        return CPU_BOUND
    if row.read_vs_ceiling >= CEILING_BOUND and row.disk_busy_share >= CEILING_BOUND:
        return DEVICE_BOUND
    return READ_PATH_BOUND


def _bound_words(row) -> str:
    return (f"{bound(row)} (storage read {row.storage_read_p50_s / row.ttft_p50_s:.0%} of TTFT "
            f"p50, {row.read_GBps:.2f} GB/s while reading = {row.read_vs_ceiling:.0%} of the "
            f"{row.ceiling_GBps:.2f} GB/s ceiling, disk busy {row.disk_busy_share:.0%} of the "
            "read span)")


def peer_comparisons(runs: dict[str, Path]) -> pd.DataFrame:
    """Each other profile against kvscope per cold phase: TTFT p50 and requests/s ratios with
    95 % bootstrap CIs (ttft_ratio > 1: kvscope's TTFT is lower; rps_ratio > 1: kvscope serves
    more requests per second)."""
    from kvscope.analysis import compare, outputs, throughput

    if CANDIDATE not in runs:
        return pd.DataFrame()
    ours = outputs.load_attribution(runs[CANDIDATE])
    our_requests = _requests(runs[CANDIDATE])
    rows = []
    for profile, run in runs.items():
        if profile == CANDIDATE:
            continue
        theirs = outputs.load_attribution(run)
        their_requests = _requests(run)
        for phase in sorted(set(theirs["phase"]) & set(ours["phase"])):
            if not phase.startswith("cold"):
                continue
            ttft = compare.compare(theirs, ours, phase=phase).set_index("component").loc["ttft"]
            rates = throughput.ratio(their_requests, our_requests, phase).set_index("metric")
            rps = rates.loc["requests_per_s"] if "requests_per_s" in rates.index else None
            rows.append({
                "profile": profile, "phase": phase, "their_ttft_p50_s": ttft.a_s,
                "kvscope_ttft_p50_s": ttft.b_s, "ttft_ratio": ttft.speedup,
                "ttft_lo": ttft.speedup_lo, "ttft_hi": ttft.speedup_hi,
                "rps_ratio": rps.ratio if rps is not None else math.nan,
                "rps_lo": rps.ratio_lo if rps is not None else math.nan,
                "rps_hi": rps.ratio_hi if rps is not None else math.nan,
            })
    return pd.DataFrame(rows)


def _requests(run: Path) -> pd.DataFrame:
    table = rundir.read_table(run, "requests")
    if table is None:
        raise ValueError(f"{run}: no requests table; is it a run directory?")
    return table


def _standing(lo: float, hi: float) -> str:
    if lo > 1:
        return "ahead"
    if hi < 1:
        return "behind"
    return "level (CI spans 1)"


def peer_verdicts(table: pd.DataFrame, compared: pd.DataFrame) -> list[str]:
    """Per other profile and cold phase: where kvscope is ahead, level or behind (the CI of
    the TTFT p50 ratio), what limits each side, and where kvscope is behind, which of its
    components would have to shrink by how much to pass."""
    if compared.empty or table.empty:
        return []
    rows = table.set_index(["profile", "phase"])
    lines = []
    for c in compared.to_dict("records"):
        profile, phase = str(c["profile"]), str(c["phase"])
        if (profile, phase) not in rows.index or (CANDIDATE, phase) not in rows.index:
            continue
        them, us = rows.loc[(profile, phase)], rows.loc[(CANDIDATE, phase)]
        standing = _standing(float(c["ttft_lo"]), float(c["ttft_hi"]))
        line = (f"`{profile}` {phase}: kvscope {standing}: TTFT p50 "
                f"{c['kvscope_ttft_p50_s']:.3f} s vs {c['their_ttft_p50_s']:.3f} s "
                f"({c['ttft_ratio']:.2f}x, CI {c['ttft_lo']:.2f}-{c['ttft_hi']:.2f}); requests/s "
                f"{c['rps_ratio']:.2f}x (CI {c['rps_lo']:.2f}-{c['rps_hi']:.2f}). `{profile}`: "
                f"{_bound_words(them)}; kvscope: {_bound_words(us)}")
        if standing == "behind":
            gaps = sorted(((getattr(us, f"{part}_p50_s") - getattr(them, f"{part}_p50_s"), part)
                           for part in ("queueing", "kv_lookup", "storage_read", "transfer",
                                        "prefill", "other")), reverse=True)
            needed = [f"{part} by {gap * 1e3:.0f} ms" for gap, part in gaps if gap >= 5e-4]
            line += ("; to pass it kvscope's p50 would have to shrink: " + ", ".join(needed)
                     if needed else "")
        lines.append(line)
    return lines


def peer_table(compared: pd.DataFrame) -> pd.DataFrame:
    """The comparison as the report prints it: ratios with their CIs in one cell each."""
    if compared.empty:
        return compared
    return pd.DataFrame({
        "profile": compared["profile"], "phase": compared["phase"],
        "their_ttft_p50_s": compared["their_ttft_p50_s"],
        "kvscope_ttft_p50_s": compared["kvscope_ttft_p50_s"],
        "ttft_ratio (ci95)": [f"{r:.2f} [{lo:.2f}, {hi:.2f}]" for r, lo, hi in zip(
            compared["ttft_ratio"], compared["ttft_lo"], compared["ttft_hi"])],
        "req_per_s_ratio (ci95)": [f"{r:.2f} [{lo:.2f}, {hi:.2f}]" for r, lo, hi in zip(
            compared["rps_ratio"], compared["rps_lo"], compared["rps_hi"])],
    })
