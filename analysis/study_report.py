"""study.md: a finished study's report, from its run directories alone.

The headline table over repetitions, the verdict, the targets, the ratios across repetitions
and the peer comparison come from the other analysis.study_* readers; the lines here say what only the manifests know: the
study's ceiling per disk, each run's read knobs and whose warm phase stored its chunk files.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvscope.analysis import study_repeats
from kvscope.analysis.study_peers import peer_verdicts
from kvscope.analysis.study_tables import headline
from kvscope.analysis.study_targets import (TARGET_BUSY, TARGET_READ, TARGET_TTFT, target_reasons,
                                           target_rows)
from kvscope.analysis.study_verdict import verdict
from kvscope.contract import files, rundir
from kvscope.contract.ceiling import best_of
from kvscope.contract.counters import READ_KNOBS_KEY


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
        c = best_of([measured])  # fills samples and spread for a single measurement
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


def knob_lines(runs: dict[str, Path]) -> list[str]:
    """The read knobs each kvscope run served with: chosen at start (tune auto) or as set."""
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


def warm_lines(runs: dict[str, Path], warm_groups: dict[str, str | None]) -> list[str]:
    """How each run that warmed in another's server got its chunk files. `warm_groups`: each
    profile's warm group (kvscope.study.warm_group; a profile not in it has none), passed in
    because which chunk format a profile stores is the capture side's to say."""
    lines = []
    for profile, run in runs.items():
        source = (rundir.read_manifest(run).get("study") or {}).get("warm_phase_from")
        if not source:
            continue
        host = rundir.read_manifest(runs[source]) if source in runs else {}
        fmt = warm_groups.get(profile)
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


def repeat_lines(reps: list[dict[str, Path]]) -> list[str]:
    """How many times each profile ran, and how later repetitions got their chunk files."""
    if len(reps) < 2:
        return ["- One repetition of each profile: the spread from one run to the next is "
                "unknown, so no comparison below is called ahead or behind (run the study "
                "with --repeats 3)."]
    return [f"- {len(reps)} repetitions of each profile, in interleaved blocks (every profile "
            "once per block; study.json's `run_order` gives the order, its `order` and `seed` "
            "how it was drawn). Later repetitions read the chunk files the first stored (a "
            "profile whose index lives in its server's memory, as stock's, warms again)."]


def write_report(study: Path, reps: list[dict[str, Path]], table: pd.DataFrame,
                 summary: pd.DataFrame, warm_groups: dict[str, str | None]) -> Path:
    """study.md: the headline table over repetitions (`table`, study_repeats.pooled_headline),
    the verdict, every ratio across repetitions (`summary`, study_repeats.replicated) and
    links to each run (`warm_groups` as in warm_lines). The verdict, targets, read knobs and
    warm phases are the first repetition's: they explain one run, not a spread."""
    runs = reps[0]
    first = rundir.read_manifest(next(iter(runs.values())))
    model, workload = first["model"], first["workload"]
    every = {run.name: run for one in reps for run in one.values()}
    lines = [
        f"# kvscope study: {' vs '.join(runs)}", "",
        f"Model twin `{model['twin']}` ({model['kv_bytes_per_token'] / 1024:g} KiB of KV per token, "
        f"{model['kv_bytes_per_chunk'] / 2**20:g} MiB per chunk); {workload['num_requests']} prompts of "
        f"{workload['prompt_tokens']} tokens; cold phases at concurrency "
        f"{', '.join(map(str, workload['concurrency']))}; machine {first['machine']['hostname']} "
        f"({first['machine']['cpus']} CPUs, disk {first['machine']['disk_device']}).", "",
        *repeat_lines(reps), "",
        "## Headline (cold phases; seconds, GB/s, per second; the median over repetitions, "
        "ratios to serial their geometric mean)", "",
        table.to_markdown(index=False, floatfmt=".3f"), "",
        "## Device ceiling (one per disk)", "", *ceiling_lines(runs), "",
        "## Read knobs", "", *knob_lines(every), "",
        "## What limits the gain", "", *[f"- {line}" for line in verdict(table, runs, summary)], "",
    ]
    targets = target_rows(runs, headline(runs))
    if not targets.empty:
        lines += [f"## Targets at c = 8 and 16, new path beside the one before it, first "
                  f"repetition (read >= {TARGET_READ}x ceiling, disk busy >= {TARGET_BUSY:.0%} "
                  f"of the read span, TTFT p50 <= {TARGET_TTFT}x the floor: bytes waited for / "
                  "ceiling + own prefill)", "", targets.to_markdown(index=False, floatfmt=".3f"),
                  "", *[f"- {line}" for line in target_reasons(runs, targets)], ""]
    if warm := warm_lines(runs, warm_groups):
        lines += ["## Warm phases", "", *warm, ""]
    if not summary.empty:
        lines += ["## Every ratio, across repetitions", "",
                  "Each profile against `against` per cold phase, > 1: the profile better "
                  "(TTFT and storage read: against's p50 over the profile's; read GB/s and "
                  "requests/s: the profile's over against's). Standing: the interval across "
                  "repetitions (a 95 % t-interval of the log ratios) above 1, below 1, level "
                  "where it includes 1, unknown spread with one repetition; the within-run "
                  "interval (a bootstrap over one run's requests) is shown, not used.", "",
                  study_repeats.table(summary).to_markdown(index=False), "",
                  *[f"- {line}" for line in study_repeats.lines(summary)], ""]
    if peers := peer_verdicts(table, summary):
        lines += ["## kvscope against the other disk paths", "",
                  "What limits each side from its attribution and block I/O (medians over "
                  "repetitions).", "", *[f"- {line}" for line in peers], ""]
    lines += ["## Runs", ""] + [f"- `{name}`: [{name}/report.md]({name}/report.md)"
                                for name in every]
    report = study / "study.md"
    files.atomic_write(report, "\n".join(lines) + "\n", files.OUTPUT_FILE_MODE)
    return report
