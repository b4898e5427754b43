"""Device-side statistics from the probe tables: bandwidth, queue depth, Little's law.

Depth is time-weighted: each sample's `inflight` holds until the next sample of the same
device and queue, so a depth seen for 1 ms weighs a thousand times one seen for 1 us.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from kvscope.analysis import blockjoin

LITTLE_TOLERANCE = 0.25  # |sampled / predicted - 1| above this is reported


def read_bandwidth(block_io: pd.DataFrame) -> list[dict[str, Any]]:
    """Per phase: bytes read, time with a read in flight, and bytes / that busy time."""
    reads = block_io[blockjoin.is_read(block_io)]
    out = []
    for phase, group in reads.groupby("phase", sort=False, observed=True):
        busy = _union_ns(group["start_ns"].to_numpy(), group["complete_ns"].to_numpy())
        total = int(group["bytes"].sum())
        span = int(group["complete_ns"].max() - group["start_ns"].min())
        out.append({"phase": str(phase), "bytes": total, "reads": len(group),
                    "busy_s": busy / 1e9, "busy_bytes_per_s": total / busy * 1e9 if busy else None,
                    "wall_s": span / 1e9, "wall_bytes_per_s": total / span * 1e9 if span else None})
    return out


def _union_ns(start: np.ndarray, end: np.ndarray) -> int:
    """Length of the union of intervals (a sweep with a running max end)."""
    if len(start) == 0:
        return 0
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    gaps = np.maximum(start[1:] - reach[:-1], 0).sum()
    return int(reach[-1] - start[0] - gaps)


def _weighted(queue_depth: pd.DataFrame) -> pd.DataFrame:
    """Samples with the time (ns) each depth held, per device and hardware queue."""
    qd = queue_depth.sort_values(["device", "hw_queue", "ts_ns"], kind="stable")
    following = qd.groupby(["device", "hw_queue"], observed=True)["ts_ns"].shift(-1)
    return qd.assign(held_ns=(following - qd["ts_ns"]).fillna(0).astype("int64"))


def depth_distribution(queue_depth: pd.DataFrame) -> list[dict[str, Any]]:
    """Per device (whole-device rows): time-weighted mean, percentiles, max and histogram."""
    weighted = _weighted(queue_depth[queue_depth["hw_queue"] == -1])
    out = []
    for (device, source), group in weighted.groupby(["device", "source"], sort=False,
                                                    observed=True):
        held = group.groupby("inflight")["held_ns"].sum()
        total = held.sum()
        if total <= 0:
            continue
        cum = held.cumsum() / total
        levels = held.index.to_numpy()
        pct = {f"p{q}": int(levels[np.searchsorted(cum.to_numpy(), q / 100)]) for q in (50, 90, 99)}
        out.append({"device": str(device), "source": str(source),
                    "mean": float((held.index.to_numpy() * held.to_numpy()).sum() / total),
                    **pct, "max": int(group["inflight"].max()), "observed_s": total / 1e9,
                    "histogram": {str(int(d)): float(w / total)
                                  for d, w in zip(levels, held.to_numpy())}})
    return out


def depth_by_phase(queue_depth: pd.DataFrame) -> list[dict[str, Any]]:
    """Per phase and device: time-weighted mean and max in flight, over that phase's samples only
    (a run's warm phase can last minutes at depth 0 and would dilute a cold phase's depth)."""
    return [{"phase": str(phase), "device": d["device"], "source": d["source"], "mean": d["mean"],
             "max": d["max"], "observed_s": d["observed_s"]}
            for phase, group in queue_depth.groupby("phase", sort=False, observed=True)
            for d in depth_distribution(group)]


def littles_law(block_io: pd.DataFrame, depth: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sampled mean depth against throughput x mean device time (issue -> complete).

    Both sides are over the depth samples' observed time; a mismatch means the probe lost
    events, the depth source misses some I/O, or the sampler is too coarse.
    """
    out = []
    for d in depth:
        # a request the flush machinery finished unissued (issue_ns -1) held no place at the device
        io = block_io[(block_io["device"] == d["device"]) & (block_io["issue_ns"] >= 0)]
        if io.empty or not d["observed_s"]:
            continue
        throughput = len(io) / d["observed_s"]
        service_s = float((io["complete_ns"] - io["issue_ns"]).mean()) / 1e9
        predicted = throughput * service_s
        ratio = d["mean"] / predicted if predicted else None
        out.append({"device": d["device"], "throughput_per_s": throughput,
                    "mean_service_s": service_s, "predicted_mean_inflight": predicted,
                    "sampled_mean_inflight": d["mean"], "ratio": ratio,
                    "consistent": bool(ratio is not None and abs(ratio - 1) <= LITTLE_TOLERANCE)})
    return out
