# SPDX-License-Identifier: Apache-2.0
"""Pure conversions from the aggregate probe's counters to run-directory tables (no BPF).

Column meanings: docs/run-directory.md (io_histograms, io_totals).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvscope.contract.rundir import TABLES
from kvscope.probes.aggregate_bpf import HIST_BASE, KINDS, NSTATS, OPS, SCALARS, SLOTS

# Counters of one (device, pid) as a (NSTATS,) u64 vector, keyed (device name, pid; -1 = all).
Counters = dict[tuple[str, int], np.ndarray]


def slot_bounds_us(slot: int) -> tuple[int, int]:
    """[lo, hi) microseconds of a bpf_log2l slot; slot 1 also holds 0 us, slot 0 is unused."""
    return (0, 2) if slot <= 1 else (1 << (slot - 1), 1 << slot)


def histograms_frame(counters: Counters, phase: str) -> pd.DataFrame:
    """io_histograms rows: one per (device, pid, op, kind, slot) with a non-zero count."""
    rows = []
    for (device, pid), v in sorted(counters.items()):
        hist = v[HIST_BASE:].reshape(len(OPS), len(KINDS), SLOTS)
        for op_i, kind_i, slot in zip(*np.nonzero(hist)):
            lo, hi = slot_bounds_us(int(slot))
            rows.append((phase, device, pid, OPS[op_i], KINDS[kind_i], int(slot), lo, hi,
                         int(hist[op_i, kind_i, slot])))
    columns = TABLES["io_histograms"].columns
    return _typed(pd.DataFrame(rows, columns=columns), ("pid", "slot", "lo_us", "hi_us", "count"))


def totals_frame(counters: Counters, phase: str, window_ns: int) -> pd.DataFrame:
    """io_totals rows: per (device, pid, op) with any request, counters and Little's-law depth."""
    rows = []
    for (device, pid), v in sorted(counters.items()):
        scalars = v[:HIST_BASE].reshape(len(SCALARS), len(OPS))
        for op_i in np.nonzero(scalars[0])[0]:
            values = {name: int(scalars[i, op_i]) for i, name in enumerate(SCALARS)}
            rows.append({"phase": phase, "device": device, "pid": pid, "op": OPS[op_i],
                         **values, "window_ns": window_ns})
    frame = _typed(pd.DataFrame(rows, columns=TABLES["io_totals"].columns), ("pid", *SCALARS, "window_ns"))
    frame["mean_service_depth"] = frame["service_ns"] / window_ns if window_ns else np.nan
    frame["mean_queue_depth"] = frame["queue_ns"] / window_ns if window_ns else np.nan
    return frame


def sum_by_key(records: list[tuple[tuple[str, int], np.ndarray]]) -> Counters:
    """Add up records that share a key (one disk seen under two indexes, per-CPU copies)."""
    out: Counters = {}
    for key, v in records:
        if v.shape != (NSTATS,):
            raise ValueError(f"stats record of shape {v.shape}, expected ({NSTATS},)")
        out[key] = out[key] + v if key in out else v.astype("uint64")
    return out


def _typed(frame: pd.DataFrame, ints: tuple[str, ...]) -> pd.DataFrame:
    return frame.astype({c: "int64" for c in ints})
