"""Throughput per phase beside TTFT: requests/s, prompt tokens/s served from storage, output
tokens/s, and the bootstrap CI of one run's rate over another's.

A phase's rate is its successful requests' count (or tokens) over its wall time, first arrival
to last finish. `storage_tokens` are the prompt tokens vLLM did not compute (usage
`cached_tokens`): in a cold phase, with vLLM's prefix cache and LMCache's CPU tier off, every
one of them was read from storage.

The CI resamples requests. A phase at fixed concurrency is a closed loop, so by Little's law its
rate is (mean requests in flight) x sum(x) / sum(latency); a resample keeps the phase's mean in
flight and redraws the requests, which gives the point estimate exactly when nothing is redrawn.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

METRICS = {"requests_per_s": None, "storage_tokens_per_s": "cached_tokens",
           "prompt_tokens_per_s": "prompt_tokens", "output_tokens_per_s": "output_tokens"}


def _ok(requests: pd.DataFrame, phase: str | None) -> pd.DataFrame:
    keep = (requests["status"].astype(str) == "ok") & (requests["finish_ns"] >= requests["arrival_ns"])
    if phase is not None:
        keep &= requests["phase"] == phase
    return requests[keep]


def _amounts(ok: pd.DataFrame, metric: str) -> np.ndarray:
    column = METRICS[metric]
    if column is None:
        return np.ones(len(ok))
    return ok[column].to_numpy("float64").clip(min=0)  # -1: the server reported no usage


def rates(ok: pd.DataFrame) -> dict[str, Any]:
    """Counts, wall time, mean requests in flight and every rate of these (ok) requests."""
    if ok.empty:
        return {"requests": 0, "wall_s": 0.0, "mean_in_flight": None,
                **{m: None for m in METRICS}}
    arrival, finish = ok["arrival_ns"].to_numpy("int64"), ok["finish_ns"].to_numpy("int64")
    wall_s = (finish.max() - arrival.min()) / 1e9
    latency_s = (finish - arrival).sum() / 1e9
    return {"requests": len(ok), "wall_s": wall_s,
            "mean_in_flight": latency_s / wall_s if wall_s else None,
            **{m: float(_amounts(ok, m).sum() / wall_s) if wall_s else None for m in METRICS}}


NEEDS = ("phase", "concurrency", "status", "arrival_ns", "finish_ns", *filter(None, METRICS.values()))


def per_phase(requests: pd.DataFrame) -> list[dict[str, Any]]:
    """One row per (phase, concurrency) of the run's requests.parquet (none when a column of
    the schema is missing: analysis.run already reported it)."""
    if any(c not in requests.columns for c in NEEDS):
        return []
    ok = _ok(requests, None)
    return [{"phase": str(group["phase"].to_numpy()[0]),
             "concurrency": int(group["concurrency"].to_numpy()[0]), **rates(group)}
            for _, group in ok.groupby(["phase", "concurrency"], sort=False)]


def _boot(ok: pd.DataFrame, metric: str, index: np.ndarray) -> np.ndarray:
    """Resampled rates: mean in flight x sum(x) / sum(latency) over each row of `index`."""
    r = rates(ok)
    latency = (ok["finish_ns"].to_numpy("int64") - ok["arrival_ns"].to_numpy("int64")) / 1e9
    x = _amounts(ok, metric)
    with np.errstate(divide="ignore", invalid="ignore"):
        return r["mean_in_flight"] * x[index].sum(axis=1) / latency[index].sum(axis=1)


def ratio(a: pd.DataFrame, b: pd.DataFrame, phase: str, *, n_boot: int = 2000,
          seed: int = 0) -> pd.DataFrame:
    """B's rate over A's per metric in `phase`, with the 95 % bootstrap interval.

    Raises:
        ValueError: a run has no successful request in the phase.
    """
    a, b = _ok(a, phase), _ok(b, phase)
    if a.empty or b.empty or not rates(a)["wall_s"] or not rates(b)["wall_s"]:
        raise ValueError(f"no successful requests in phase {phase!r} of "
                         f"{'A' if a.empty or not rates(a)['wall_s'] else 'B'}; pick a phase "
                         "both runs have")
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(a), (n_boot, len(a)))
    ib = rng.integers(0, len(b), (n_boot, len(b)))
    ra, rb = rates(a), rates(b)
    out = []
    for metric in METRICS:
        if not ra[metric]:
            continue  # e.g. no tokens served from storage in A: no ratio to give
        with np.errstate(divide="ignore", invalid="ignore"):
            boot = _boot(b, metric, ib) / _boot(a, metric, ia)
        boot = boot[np.isfinite(boot)]
        out.append({"phase": phase, "metric": metric, "a": ra[metric], "b": rb[metric],
                    "ratio": rb[metric] / ra[metric],
                    "ratio_lo": float(np.percentile(boot, 2.5)) if len(boot) else float("nan"),
                    "ratio_hi": float(np.percentile(boot, 97.5)) if len(boot) else float("nan")})
    return pd.DataFrame(out, columns=["phase", "metric", "a", "b", "ratio", "ratio_lo", "ratio_hi"])
