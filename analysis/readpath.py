"""What held a phase's KV reads below the device ceiling, from the per-read timelines recorded.

Two ways a read path loses bandwidth, told apart on the block I/Os of the backend's reader
threads (their tids ride on the storage.read spans) and the request spans:

- the disk sits idle inside the phase's read span: nothing in flight while the worker copies
  loaded chunks into the KV cache (`kv.transfer`) or prefills; `idle_*_s` says which;
- or idle because nothing was asked of it: no request of the phase had arrived and still waited
  for its reads (a closed-loop client between waves, decode steps); `idle_unasked_s` says how
  much, so the read path is judged only on the time reads were wanted;
- while busy, fewer reads are in flight than the backend has readers: each reader spends time
  between its reads (verifying the checksum, bookkeeping, waiting for a core the engine also
  wants); `reader_gap_p50_ms` against `io_p50_ms` (a read's time at the device) says how much.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pyarrow.compute as pc

from kvscope.analysis import blockjoin, spantable
from kvscope.contract import semconv

BACK_TO_BACK_NS = 20_000_000  # a reader's next read within this was waiting on the reader, not on work
GAP_CAUSES = "checksum, bookkeeping, waiting for a core"  # what a reader's gap between reads holds
IDLE_CAUSES = {"transfer": semconv.SPAN_KV_TRANSFER, "prefill": semconv.SPAN_PREFILL}


def _union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals as sorted, disjoint (starts, ends); touching intervals merge."""
    if len(start) == 0:
        return start, end
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    first = np.flatnonzero(np.r_[True, start[1:] > reach[:-1]])
    return start[first], reach[np.r_[first[1:] - 1, len(start) - 1]]


def _covered_ns(gaps: tuple[np.ndarray, np.ndarray], spans: pd.DataFrame) -> int:
    """How much of the gaps (sorted, disjoint) the spans cover (their union, clipped to each
    gap): the covered time up to each gap's end minus that up to its start."""
    starts, ends = _union(spans["start_ns"].to_numpy(np.int64), spans["end_ns"].to_numpy(np.int64))
    if len(starts) == 0 or len(gaps[0]) == 0:
        return 0
    lengths = ends - starts
    before = np.r_[0, np.cumsum(lengths)]  # covered time before each interval

    def covered_until(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(starts, t, side="right")  # intervals starting at or before t
        last = np.maximum(k - 1, 0)
        partial = np.clip(t - starts[last], 0, lengths[last])
        return np.where(k > 0, before[last] + partial, 0)

    return int((covered_until(gaps[1]) - covered_until(gaps[0])).sum())


def _waiting(in_phase: pd.DataFrame) -> pd.DataFrame:
    """Per request that read: from its arrival at the server to the end of its last read."""
    def of(name: str) -> pd.DataFrame:
        return in_phase[in_phase["name"] == name]

    reads = of(semconv.SPAN_STORAGE_READ).groupby("request_id")["end_ns"].max()
    arrived = of(semconv.SPAN_SERVER_REQUEST).groupby("request_id")["start_ns"].min()
    both = pd.concat({"start_ns": arrived, "end_ns": reads}, axis=1, join="inner")
    return both.astype(np.int64)


def _reader_tids(reads: pd.DataFrame) -> np.ndarray:
    """Every thread id the storage.read spans name as a reader."""
    tids = spantable.arrow(reads, semconv.READER_TIDS)
    return pc.unique(pc.list_flatten(tids)).drop_null().to_numpy(zero_copy_only=False)


def phase_reads(block_io: pd.DataFrame, spans: pd.DataFrame, requests: pd.DataFrame,
                phase: str) -> dict[str, Any] | None:
    """The read-path timeline of one phase (None when its readers did no block reads)."""
    in_phase = spans[spans["request_id"].isin(
        requests.loc[requests["phase"] == phase, "request_id"].astype(str))]
    tids = _reader_tids(in_phase[in_phase["name"] == semconv.SPAN_STORAGE_READ])
    io = block_io[(block_io["phase"] == phase) & blockjoin.is_read(block_io)
                  & block_io["tid"].isin(tids)]
    if io.empty:
        return None
    start, issue = io["start_ns"].to_numpy(np.int64), io["issue_ns"].to_numpy(np.int64)
    end = io["complete_ns"].to_numpy(np.int64)
    busy_starts, busy_ends = _union(start, end)
    busy_ns = int((busy_ends - busy_starts).sum())
    gaps = (busy_ends[:-1], busy_starts[1:])
    ordered = io.sort_values(["tid", "start_ns"], kind="stable")
    same = (ordered["tid"].to_numpy()[1:] == ordered["tid"].to_numpy()[:-1])
    between = ordered["start_ns"].to_numpy(np.int64)[1:] - ordered["complete_ns"].to_numpy(np.int64)[:-1]
    back_to_back = between[same & (between >= 0) & (between < BACK_TO_BACK_NS)] / 1e6
    idle_ns = int((gaps[1] - gaps[0]).sum())
    return {
        "phase": phase, "readers": len(tids), "reads": len(io), "bytes": int(io["bytes"].sum()),
        "read_span_s": (end.max() - start.min()) / 1e9, "busy_s": busy_ns / 1e9,
        "busy_bytes_per_s": float(io["bytes"].sum()) / busy_ns * 1e9 if busy_ns else None,
        "in_flight_while_busy": float((end - start).sum() / busy_ns) if busy_ns else None,
        "at_device_while_busy": float((end - issue).sum() / busy_ns) if busy_ns else None,
        "io_p50_ms": float(np.median(end - issue) / 1e6),
        "reader_gap_p50_ms": float(np.median(back_to_back)) if len(back_to_back) else None,
        "reader_gap_p90_ms": float(np.percentile(back_to_back, 90)) if len(back_to_back) else None,
        "idle_s": idle_ns / 1e9,
        "idle_unasked_s": (idle_ns - _covered_ns(gaps, _waiting(in_phase))) / 1e9,
        **{f"idle_{cause}_s": _covered_ns(gaps, in_phase[in_phase["name"] == name]) / 1e9
           for cause, name in IDLE_CAUSES.items()},
    }


def per_phase(block_io: pd.DataFrame, spans: pd.DataFrame, requests: pd.DataFrame
              ) -> list[dict[str, Any]]:
    """phase_reads for every cold phase that read from the disk."""
    if spans.empty or block_io.empty or requests.empty:
        return []
    cold = [p for p in dict.fromkeys(requests["phase"].astype(str)) if p.startswith("cold")]
    return [r for p in cold if (r := phase_reads(block_io, spans, requests, p)) is not None]


def words(r: dict[str, Any]) -> str:
    """One sentence: where the phase's read bandwidth went."""
    idle = r["idle_s"] / r["read_span_s"] if r["read_span_s"] else 0.0
    text = (f"the disk was idle {idle:.0%} of the {r['read_span_s']:.2f} s read span "
            f"({r['idle_transfer_s']:.2f} s of it while the worker copied loaded chunks into the "
            f"KV cache, {r['idle_prefill_s']:.2f} s while it prefilled, "
            f"{r['idle_unasked_s']:.2f} s while no request was waiting for its reads)")
    if r["in_flight_while_busy"] is not None and r["readers"] > 1:
        text += (f"; while busy, {r['in_flight_while_busy']:.1f} reads of {r['readers']} readers "
                 f"were in flight, each read {r['io_p50_ms']:.1f} ms at the device (p50)")
        if r["reader_gap_p50_ms"] is not None:
            text += (f" and each reader {r['reader_gap_p50_ms']:.1f} ms (p50, p90 "
                     f"{r['reader_gap_p90_ms']:.1f} ms) between its reads ({GAP_CAUSES})")
    return text
