"""Join block-layer reads to the storage-read spans that caused them.

A storage.read span lists the threads that issued its reads (kvscope.storage.reader_tids). A
block read belongs to the span whose reader thread submitted it while the span was open:
an as-of merge per thread id finds the latest span that started at or before the I/O, and
the I/O must start no later than that span ended (inclusive: back-to-back spans touch).
Schema v1 carries no file offsets on spans, so threads and time windows are the whole key.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvscope.contract import semconv

JOINED_COLUMNS = ("key", "start_ns", "issue_ns", "complete_ns", "bytes", "ambiguous")


def reader_windows(reads: pd.DataFrame) -> pd.DataFrame:
    """One row per (storage.read span, reader tid): key, tid, win_start, win_end, overlapped.

    `reads` has columns key, start_ns, end_ns, attributes. `overlapped` marks a window that
    opened while an earlier window of the same thread was still open: I/O in it is ambiguous.
    """
    tids = [_tid_list(a.get(semconv.READER_TIDS)) for a in reads["attributes"]]
    windows = pd.DataFrame({"key": reads["key"].to_numpy(), "tid": tids,
                            "win_start": reads["start_ns"].to_numpy(),
                            "win_end": reads["end_ns"].to_numpy()})
    windows = windows.explode("tid").dropna(subset=["tid"]).astype({"tid": "int64"})
    windows = windows.sort_values(["tid", "win_start"], kind="stable")
    latest_end = windows.groupby("tid")["win_end"].cummax()
    previous_end = latest_end.groupby(windows["tid"]).shift(1)
    windows["overlapped"] = (windows["win_start"] < previous_end).to_numpy()
    return windows.reset_index(drop=True)


def join(windows: pd.DataFrame, block_io: pd.DataFrame) -> pd.DataFrame:
    """Block reads matched to a window, with the window's request key (JOINED_COLUMNS)."""
    io = block_io.loc[block_io["op"].astype(str).str.startswith("R"),
                      ["tid", "start_ns", "issue_ns", "complete_ns", "bytes"]]
    io = io.astype({"tid": "int64"}).sort_values("start_ns", kind="stable")
    if io.empty or windows.empty:
        return pd.DataFrame({c: pd.Series(dtype="bool" if c == "ambiguous" else "int64")
                             for c in JOINED_COLUMNS})
    merged = pd.merge_asof(io, windows.sort_values("win_start", kind="stable"),
                           left_on="start_ns", right_on="win_start", by="tid",
                           direction="backward")
    hit = merged["win_end"].notna() & (merged["start_ns"] <= merged["win_end"])
    merged = merged[hit]
    out = merged[["key", "start_ns", "issue_ns", "complete_ns", "bytes"]].astype("int64")
    out["ambiguous"] = merged["overlapped"].astype(bool).to_numpy()
    return out.reset_index(drop=True)


def _tid_list(value: object) -> list[int] | float:
    """Reader tids from the attribute (a list, one int, or a comma string); NaN when absent."""
    if value is None:
        return np.nan
    if isinstance(value, str):
        return [int(v) for v in value.replace(" ", "").split(",") if v] or np.nan
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value] or np.nan
    return [int(value)]
