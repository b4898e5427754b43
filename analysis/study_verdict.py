"""What limits the parallel path's gain in a finished study, in words, per concurrency level.

One line per cold phase of the candidate from the study's headline table
(analysis.study_tables): the device, the read path, or the rest of TTFT, with the figures that
say so, and where that phase's read bandwidth went.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from kvscope.analysis import readpath, replicates
from kvscope.analysis.study_tables import CEILING_BOUND, MINOR_SHARE, phase_row
from kvscope.contract.study_roles import BASELINE, CANDIDATE


def verdict(table: pd.DataFrame, runs: dict[str, Path] | None = None,
            summary: pd.DataFrame | None = None) -> list[str]:
    """What limits the gain, in numbers, per concurrency level of the parallel path; with the
    runs, each line ends with where that phase's read bandwidth went (analysis.readpath); with
    the ratios across repetitions (analysis.study_repeats.replicated), each gain over serial
    says where it stands by their rule, so no line claims a gain the spread does not show."""
    standings = _standings(summary)
    return [_limit(row, standings) + _where_reads_went(runs, str(row.phase))
            for row in table[table["profile"] == CANDIDATE].itertuples()]


def _standings(summary: pd.DataFrame | None) -> dict[tuple[str, str], str]:
    """(phase, metric) -> " (level across 3 repetitions)" and the like, for the candidate
    against the serial baseline."""
    if summary is None or summary.empty:
        return {}
    ours = summary[(summary["profile"] == CANDIDATE) & (summary["against"] == BASELINE)]
    return {(str(r["phase"]), str(r["metric"])):
            f" ({replicates.UNKNOWN}: one repetition)" if r["reps"] < 2
            else f" ({replicates.SAID[r['standing']]} across {r['reps']} repetitions)"
            for r in ours.to_dict("records")}


def _where_reads_went(runs: dict[str, Path] | None, phase: str) -> str:
    if not runs or CANDIDATE not in runs:
        return ""
    summary = json.loads((runs[CANDIDATE] / "summary.json").read_text())
    row = phase_row(summary, "read_path", phase)
    return f". Read path: {readpath.words(row)}" if row else ""


def _limit(row, standings: dict[tuple[str, str], str]) -> str:
    """The verdict for one row of the parallel path."""
    share = row.read_vs_ceiling
    read_share = row.storage_read_p50_s / row.ttft_p50_s if row.ttft_p50_s else math.nan
    gain = (f"speedup over serial {row.speedup_vs_serial:.2f}x"
            f"{standings.get((str(row.phase), 'ttft'), '')}, throughput "
            f"{row.throughput_vs_serial:.2f}x"
            f"{standings.get((str(row.phase), 'requests_per_s'), '')}")
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
