"""A finished study's numbers per profile and cold phase, read from its run directories.

`kvscope demo` makes the runs (kvscope.study); reading them back is a reader's job, so a
dashboard or CI can judge a study copied from another machine, with no vLLM or LMCache
installed. The headline table here, one repetition's, is what the verdicts, the targets, the
ratios across repetitions (analysis.study_repeats) and study.md (analysis.study_report) are
built on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from kvscope.analysis.findings import ceiling_of, phase_reads
from kvscope.contract import rundir
from kvscope.contract.study_roles import BASELINE, CANDIDATE

CEILING_BOUND = 0.8  # reads at or above this share of the ceiling: the device limits the gain
MINOR_SHARE = 0.2  # storage reads below this share of TTFT cannot limit the gain much
DEVICE_BOUND, READ_PATH_BOUND, CPU_BOUND = "device-bound", "read-path-bound", "CPU-bound"


def _seconds(group: dict, component: str, stat: str) -> float:
    return group["percentiles_ns"].get(component, {}).get(stat, math.nan) / 1e9


def _read_rates(summary: dict, phase: str) -> tuple[float, float]:
    """(bytes/s while a read was in flight, share of the phase's read span the disk was busy),
    as the run's findings say them (analysis.findings.phase_reads)."""
    reads = phase_reads(summary, phase)
    if reads is None or reads["busy_share"] is None:
        return math.nan, math.nan
    return reads["busy_bytes_per_s"], reads["busy_share"]


def phase_row(summary: dict, key: str, phase: str) -> dict:
    """One phase's row of a summary's per-phase list (`throughput`, `read_path`, ...), `{}` when
    the phase has none: the headline, the verdict and the target reasons all read them."""
    return next((r for r in summary.get(key, []) if r["phase"] == phase), {})


def headline(runs: dict[str, Path]) -> pd.DataFrame:
    """Per profile and cold phase: TTFT and component percentiles, throughput, read rate
    against the study's one ceiling for the disk (capped at 1: above it, `ceiling_under_by`)."""
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
            rates = phase_row(summary, "throughput", group["phase"])
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
                "in_flight": phase_row(summary, "queue_depth_by_phase", group["phase"]).get(
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
