"""kvscope against LMCache's other disk paths (the peers) in a finished study.

Each other profile's cold phases against kvscope's: where kvscope is ahead, level or behind by
the study's one rule over its repetitions (analysis.replicates.standing, on the TTFT p50 ratio
that analysis.study_repeats computes), what limits each side (analysis.study_tables.bound), and
where it is behind, which of its TTFT parts would have to shrink by how much to pass.
"""

from __future__ import annotations

import pandas as pd

from kvscope.analysis import replicates
from kvscope.analysis.study_repeats import compact
from kvscope.analysis.study_tables import bound
from kvscope.contract.study_roles import CANDIDATE

STANDING = {replicates.ABOVE: "ahead", replicates.BELOW: "behind",
            replicates.LEVEL: "level (interval across repetitions spans 1)",
            replicates.UNKNOWN: "of unknown standing (one repetition: spread unknown)"}


def peer_verdicts(table: pd.DataFrame, summary: pd.DataFrame) -> list[str]:
    """Per other profile and cold phase: where kvscope stands (its TTFT p50 ratio's standing
    in `summary`, study_repeats.replicated), what limits each side (from `table`, the headline
    over repetitions), and where kvscope is behind, which of its components would have to
    shrink by how much to pass."""
    if summary.empty or table.empty:
        return []
    rows = table.set_index(["profile", "phase"])
    p50 = rows["ttft_p50_s"]
    ours = summary[summary["profile"] == CANDIDATE]
    lines = []
    for (against, at), group in ours.groupby(["against", "phase"], sort=False):
        profile, phase, by = str(against), str(at), group.set_index("metric")
        if ("ttft" not in by.index or (profile, phase) not in rows.index
                or (CANDIDATE, phase) not in rows.index):
            continue
        them, us = rows.loc[(profile, phase)], rows.loc[(CANDIDATE, phase)]
        ttft = by.loc["ttft"].to_dict()
        standing = str(ttft["standing"])
        line = (f"`{profile}` {phase}: kvscope {STANDING[standing]}: TTFT p50 "
                f"{p50[(CANDIDATE, phase)]:.3f} s vs {p50[(profile, phase)]:.3f} s ("
                + replicates.figures(ttft) + ")"
                + "".join(f"; {compact(by.loc[m].to_dict(), 'requests/s')}"
                          for m in ("requests_per_s",) if m in by.index)
                + f". `{profile}`: {_bound_words(them)}; kvscope: {_bound_words(us)}")
        if standing == replicates.BELOW:
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
