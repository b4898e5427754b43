"""Ratios across a study's repetitions: their interval, and the one rule that calls a comparison
ahead, behind or level, shared by the study's headline and the acceptance gates.

Why across repetitions: a bootstrap over one run's requests says how sure that run is of its own
median, not how much a second run would differ (the machine's load, where the chunks landed on
disk, the server's start). Two profiles within 10 % of each other swapped places on a rerun while
each run's interval excluded 1. So each repetition gives one ratio (profile over baseline, in
the same block of the study), and the interval is a Student t-interval over those ratios on the
log scale: ratios multiply, and on that scale the interval of B / A is exactly the inverse of
A / B's, so the rule cannot depend on which way round a ratio is written.

The rule (`standing`), applied to the across-repetition interval alone:
- fewer than two repetitions: UNKNOWN, the run-to-run spread is unknown, no winner is claimed;
- the interval's lower end above the bar (1 for a ratio, a gate's `min`): ABOVE;
- its upper end below the bar: BELOW;
- otherwise (the interval includes the bar): LEVEL.
Each repetition's ratio already carries its own run's request-to-request noise, so the
across-repetition interval covers both sources; the within-run interval is shown beside it
(`run_lo`, `run_hi`) but decides nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

ABOVE, BELOW, LEVEL, UNKNOWN = "above", "below", "level", "unknown spread"
SAID = {ABOVE: "ahead", BELOW: "behind", LEVEL: LEVEL, UNKNOWN: UNKNOWN}  # a ratio's standing
# two-sided 95 % Student t quantiles by degrees of freedom (a table: no scipy in the readers)
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
       2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
       2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Z95 = 1.959964
PER_REP = ("rep", "ratio", "run_lo", "run_hi")


def t95(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom: the table up to 30, a
    Cornish-Fisher expansion beyond (within 1e-3 there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df <= len(T95):
        return T95[df - 1]
    z = Z95
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


@dataclass(frozen=True)
class Spread:
    """A ratio over repetitions: geometric mean, 95 % interval (NaN with one), how many."""

    center: float
    lo: float
    hi: float
    reps: int

    def complement(self) -> "Spread":
        """The spread of 1 - ratio (a gate's `reduction`): the ends swap."""
        return Spread(1 - self.center, 1 - self.hi, 1 - self.lo, self.reps)


def spread(ratios: Sequence[float] | np.ndarray) -> Spread:
    """The t-interval of positive ratios on the log scale; non-finite or non-positive ratios
    (a run with no reads in the phase) are left out, and the count says how many remained."""
    values = np.asarray(ratios, dtype="float64")
    logs = np.log(values[np.isfinite(values) & (values > 0)])
    n = len(logs)
    if n == 0:
        return Spread(math.nan, math.nan, math.nan, 0)
    mean = float(logs.mean())
    if n < 2:
        return Spread(math.exp(mean), math.nan, math.nan, n)
    half = t95(n - 1) * float(logs.std(ddof=1)) / math.sqrt(n)
    return Spread(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n)


def standing(s: Spread, bar: float = 1.0) -> str:
    """ABOVE, BELOW, LEVEL or UNKNOWN: the rule of the module's docstring, for the headline
    and the gates alike."""
    if s.reps < 2 or math.isnan(s.lo) or math.isnan(s.hi):
        return UNKNOWN
    if s.lo > bar:
        return ABOVE
    if s.hi < bar:
        return BELOW
    return LEVEL


def across(per_rep: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """One row per comparison from one row per comparison and repetition.

    Args:
        per_rep: `keys`, then `rep`, `ratio` (> 1: the profile better), `run_lo` and `run_hi`
            (that run's own 95 % interval, NaN where none is computed).
        keys: the columns naming a comparison (e.g. profile, against, phase, metric).

    Returns:
        `keys`, `reps`, `ratio` (geometric mean over repetitions), `rep_lo`, `rep_hi` (the
        95 % t-interval across them, NaN with one), `run_lo`, `run_hi` (the median over
        repetitions of each end of the within-run interval: what one run would have said),
        `ratios` (each repetition's, in repetition order) and `standing` (the rule against 1).

    Raises:
        ValueError: a column is missing.
    """
    missing = [c for c in (*keys, *PER_REP) if c not in per_rep.columns]
    if missing:
        raise ValueError(f"per-repetition ratios lack columns {missing}")
    out = []
    for key, group in per_rep.sort_values("rep").groupby(list(keys), sort=False):
        s = spread(group["ratio"].to_numpy("float64"))
        out.append({**dict(zip(keys, key if isinstance(key, tuple) else (key,))),
                    "reps": s.reps, "ratio": s.center, "rep_lo": s.lo, "rep_hi": s.hi,
                    "run_lo": float(group["run_lo"].median()),
                    "run_hi": float(group["run_hi"].median()),
                    "ratios": tuple(float(r) for r in group["ratio"]),
                    "standing": standing(s)})
    return pd.DataFrame(out, columns=[*keys, "reps", "ratio", "rep_lo", "rep_hi", "run_lo",
                                      "run_hi", "ratios", "standing"])


def words(row: dict, *, above: str = "ahead", below: str = "behind") -> str:
    """A comparison row of `across` in words: its standing first (`above` / `below` name the
    sides), then its figures."""
    said = {ABOVE: above, BELOW: below, LEVEL: "level (the interval across repetitions "
            "includes 1)", UNKNOWN: "unknown spread (one repetition: no winner claimed; "
            "run the study with --repeats 3)"}[row["standing"]]
    return f"{said}: {figures(row)}"


def figures(row: dict) -> str:
    """The ratio, its interval across repetitions and each repetition's, and the within-run
    interval: every number the standing was read from."""
    within = (f"; within one run {row['run_lo']:.2f}-{row['run_hi']:.2f}"
              if not math.isnan(row["run_lo"]) else "")
    if row["reps"] < 2:
        return f"{row['ratio']:.2f}x{within}"
    each = ", ".join(f"{r:.2f}" for r in row["ratios"])
    return (f"{row['ratio']:.2f}x, 95 % interval across {row['reps']} repetitions "
            f"{row['rep_lo']:.2f}-{row['rep_hi']:.2f} (each {each}){within}")
