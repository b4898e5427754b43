"""Compare two runs' attributions: per-component deltas and speedups with bootstrap CIs.

Each run is resampled with replacement (independently, `n_boot` times); the statistic (p50 by
default) of every resample gives a distribution of B - A and A / B whose 2.5th and 97.5th
percentiles are the 95 % interval. Only complete (non-partial) rows of the chosen phase count.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvscope.analysis.attribution import COMPONENTS, STORAGE_PARTS

PARTS = ("ttft", *COMPONENTS, *STORAGE_PARTS)
STATS = {"p50": lambda a: np.median(a, axis=1), "p90": lambda a: np.percentile(a, 90, axis=1),
         "mean": lambda a: a.mean(axis=1)}


def rows(attribution: pd.DataFrame, phase: str | None) -> pd.DataFrame:
    """Complete rows of `phase` (all phases when None)."""
    keep = ~attribution["partial"].astype(bool)
    if phase is not None:
        keep &= attribution["phase"] == phase
    return attribution[keep]


def compare(a: pd.DataFrame, b: pd.DataFrame, *, phase: str | None = None, stat: str = "p50",
            n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """One row per component: A, B (seconds), delta B-A and speedup A/B, each with a 95 % CI."""
    if stat not in STATS:
        raise ValueError(f"stat must be one of {sorted(STATS)}, got {stat!r}")
    a, b = rows(a, phase), rows(b, phase)
    if a.empty or b.empty:
        raise ValueError(f"no complete requests{f' in phase {phase!r}' if phase else ''} in "
                         f"{'A' if a.empty else 'B'}; pick --phase from its phases")
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(a), (n_boot, len(a)))
    ib = rng.integers(0, len(b), (n_boot, len(b)))
    out = []
    for part in PARTS:
        va = a[f"{part}_ns"].to_numpy("float64") / 1e9
        vb = b[f"{part}_ns"].to_numpy("float64") / 1e9
        sa, sb = STATS[stat](va[None, :]), STATS[stat](vb[None, :])
        ba, bb = STATS[stat](va[ia]), STATS[stat](vb[ib])
        with np.errstate(divide="ignore", invalid="ignore"):
            speed = ba / bb
        out.append({"component": part, "a_s": float(sa[0]), "b_s": float(sb[0]),
                    "delta_s": float(sb[0] - sa[0]),
                    "delta_lo": float(np.percentile(bb - ba, 2.5)),
                    "delta_hi": float(np.percentile(bb - ba, 97.5)),
                    "speedup": float(sa[0] / sb[0]) if sb[0] else float("nan"),
                    "speedup_lo": float(np.nanpercentile(speed, 2.5)) if np.isfinite(speed).any() else float("nan"),
                    "speedup_hi": float(np.nanpercentile(speed, 97.5)) if np.isfinite(speed).any() else float("nan")})
    return pd.DataFrame(out)
