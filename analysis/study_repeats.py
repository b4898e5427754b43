"""A finished study's ratios over its repetitions: every profile against the serial baseline
and kvscope against every other profile, per cold phase, each with the interval across
repetitions and the within-run one (analysis.replicates says how, and the rule that reads them).

A repetition is one block of the study (kvscope.study.block_orders): every profile ran once in
it, so each ratio pairs two runs made close in time, and a drift of the shared machine between
blocks moves both sides of it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from kvscope.analysis import compare, outputs, replicates, throughput
from kvscope.analysis.study_tables import bound, headline
from kvscope.contract import rundir
from kvscope.contract.study_roles import BASELINE, CANDIDATE

# metric -> its name in words; every ratio is oriented so that > 1 means the profile is better
METRICS = {"ttft": "TTFT p50", "storage_read": "storage read p50", "read_GBps": "read GB/s",
           "requests_per_s": "requests/s"}
KEYS = ("profile", "against", "phase", "metric")


def pairs(profiles: list[str]) -> list[tuple[str, str]]:
    """(profile, against): every profile against the serial baseline, then kvscope against
    every other profile but the baseline (already compared)."""
    first = [(p, BASELINE) for p in profiles if p != BASELINE] if BASELINE in profiles else []
    second = ([(CANDIDATE, p) for p in profiles if p not in (CANDIDATE, BASELINE)]
              if CANDIDATE in profiles else [])
    return first + second


def _run_tables(run: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    requests = rundir.read_table(run, "requests")
    if requests is None:
        raise ValueError(f"{run}: no requests table; is it a run directory?")
    return outputs.load_attribution(run), requests


def ratio_rows(runs: dict[str, Path], rep: int) -> pd.DataFrame:
    """One repetition's ratios, one row per pair, cold phase and metric: `KEYS`, `rep`,
    `ratio` and its within-run 95 % bootstrap interval (`run_lo`, `run_hi`; none for read
    GB/s, a rate of the phase's block reads)."""
    tables = {p: _run_tables(r) for p, r in runs.items()}
    heads = headline(runs)
    rates = {} if heads.empty else dict(zip(zip(heads["profile"], heads["phase"]),
                                            heads["read_GBps"]))
    rows = []
    for profile, against in pairs(list(runs)):
        (theirs, their_requests), (ours, our_requests) = tables[against], tables[profile]
        for phase in sorted(set(theirs["phase"]) & set(ours["phase"])):
            if not phase.startswith("cold"):
                continue
            key = {"profile": profile, "against": against, "phase": phase, "rep": rep}
            parts = compare.compare(theirs, ours, phase=phase).set_index("component")
            for part in ("ttft", "storage_read"):
                r = parts.loc[part]
                rows.append({**key, "metric": part, "ratio": r.speedup, "run_lo": r.speedup_lo,
                             "run_hi": r.speedup_hi})
            served = throughput.ratio(their_requests, our_requests, phase).set_index("metric")
            if "requests_per_s" in served.index:
                r = served.loc["requests_per_s"]
                rows.append({**key, "metric": "requests_per_s", "ratio": r.ratio,
                             "run_lo": r.ratio_lo, "run_hi": r.ratio_hi})
            if (profile, phase) in rates and (against, phase) in rates:
                rows.append({**key, "metric": "read_GBps", "run_lo": math.nan,
                             "run_hi": math.nan, "ratio": rates[(profile, phase)]
                             / rates[(against, phase)]})
    return pd.DataFrame(rows, columns=[*KEYS, *replicates.PER_REP])


def replicated(reps: list[dict[str, Path]]) -> pd.DataFrame:
    """Every ratio of the study across its repetitions (replicates.across), in pair order."""
    per_rep = pd.concat([ratio_rows(runs, rep) for rep, runs in enumerate(reps, start=1)],
                        ignore_index=True)
    return replicates.across(per_rep, KEYS)


def pooled_headline(reps: list[dict[str, Path]]) -> pd.DataFrame:
    """The headline table (study_tables.headline) over repetitions: per profile and cold
    phase, the median of each column over them, the ratios to the serial baseline as their
    geometric mean (what `replicated` reports), the bound of those medians, and `reps`."""
    tables = [headline(runs) for runs in reps]
    every = pd.concat(tables, ignore_index=True)
    if every.empty:
        return every
    keys = ["profile", "phase", "conc"]
    numeric = [c for c in every.select_dtypes("number").columns if c not in keys]
    table = every.groupby(keys, sort=False)[numeric].median()
    for ratio in ("speedup_vs_serial", "throughput_vs_serial"):
        table[ratio] = every.groupby(keys, sort=False)[ratio].agg(
            lambda r: replicates.spread(r.to_numpy("float64")).center)
    table["reps"] = every.groupby(keys, sort=False).size()
    table = table.reset_index()
    table["bound"] = [bound(row) for row in table.itertuples()]
    return table[[*tables[0].columns, "reps"]]


def lines(summary: pd.DataFrame, against: str = BASELINE) -> list[str]:
    """Per profile and cold phase compared with `against`: where it stands by TTFT p50 (the
    rule, replicates.standing), then each other ratio with its interval and standing."""
    picked = summary[summary["against"] == against]
    out = []
    for (profile, phase), group in picked.groupby(["profile", "phase"], sort=False):
        by = group.set_index("metric")
        if "ttft" not in by.index:
            continue
        head = replicates.words(by.loc["ttft"].to_dict(), above="faster", below="slower")
        rest = [compact(by.loc[m].to_dict(), METRICS[m]) for m in METRICS
                if m != "ttft" and m in by.index]
        out.append(f"`{profile}` against `{against}`, {phase}: TTFT p50 {head}; "
                   + "; ".join(rest))
    return out


def compact(row: dict, label: str) -> str:
    """One ratio in a few words: value, interval across repetitions, standing."""
    if row["reps"] < 2:
        return f"{label} {row['ratio']:.2f}x ({replicates.UNKNOWN})"
    return (f"{label} {row['ratio']:.2f}x [{row['rep_lo']:.2f}, {row['rep_hi']:.2f}] "
            f"{replicates.SAID[row['standing']]}")


def table(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary as study.md prints it: each interval in one cell."""
    def cell(lo: pd.Series, hi: pd.Series) -> list[str]:
        return ["-" if math.isnan(a) else f"[{a:.2f}, {b:.2f}]" for a, b in zip(lo, hi)]

    return pd.DataFrame({
        "profile": summary["profile"], "against": summary["against"], "phase": summary["phase"],
        "ratio": [f"{METRICS[m]} {r:.2f}x" for m, r in zip(summary["metric"], summary["ratio"])],
        "reps": summary["reps"],
        "across repetitions (95 %)": cell(summary["rep_lo"], summary["rep_hi"]),
        "within a run (95 %, median)": cell(summary["run_lo"], summary["run_hi"]),
        "each repetition": [", ".join(f"{r:.2f}" for r in rs) for rs in summary["ratios"]],
        "standing": summary["standing"].map(replicates.SAID)})
