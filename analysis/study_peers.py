"""kvscope against LMCache's other disk paths (the peers) in a finished study.

Each other profile's cold phases against kvscope's, with bootstrap CIs: where kvscope is ahead,
level or behind, what limits each side (analysis.study_tables.bound), and where it is behind,
which of its TTFT parts would have to shrink by how much to pass.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from kvscope.analysis import compare, outputs, throughput
from kvscope.analysis.study_tables import bound
from kvscope.contract import rundir
from kvscope.contract.study_roles import CANDIDATE


def peer_comparisons(runs: dict[str, Path]) -> pd.DataFrame:
    """Each other profile against kvscope per cold phase: TTFT p50 and requests/s ratios with
    95 % bootstrap CIs (ttft_ratio > 1: kvscope's TTFT is lower; rps_ratio > 1: kvscope serves
    more requests per second)."""
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


def _bound_words(row) -> str:
    return (f"{bound(row)} (storage read {row.storage_read_p50_s / row.ttft_p50_s:.0%} of TTFT "
            f"p50, {row.read_GBps:.2f} GB/s while reading = {row.read_vs_ceiling:.0%} of the "
            f"{row.ceiling_GBps:.2f} GB/s ceiling, disk busy {row.disk_busy_share:.0%} of the "
            "read span)")


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
