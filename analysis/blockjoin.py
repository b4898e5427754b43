"""Join block-layer reads to the storage-read spans (and so the requests) that caused them.

By location first: a kvscope-backend storage.read span says on which disk sectors each chunk it
read lies and in which time window it was read (docs/run-directory.md, "Joining block reads to
requests"). A block read on that disk that overlaps a chunk's sectors and is in flight inside
that chunk's window read that chunk: exact whatever thread or I/O engine submitted it, under
read-ahead and any concurrency. Only when two requests read the same sectors at the same time
(the same chunk, read twice at once) is the read ambiguous; it goes to the read that started
last and is flagged.

By thread and time for spans that give no location (LMCache's own disk tiers, files on devices
whose sectors the probes do not see): a span lists the threads that issued its reads
(kvscope.storage.reader_tids), and a block read belongs to the span whose reader thread
submitted it while the span was open, the latest such span when several were (then flagged
ambiguous: spans of one thread overlapped).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from kvscope.contract import semconv

JOINED_COLUMNS = ("key", "start_ns", "issue_ns", "complete_ns", "bytes", "ambiguous", "method")
# The storage.read attributes the join reads.
ATTRIBUTE_KEYS = (semconv.READER_TIDS, semconv.READ_DEVICE, semconv.READ_CHUNK_SUBMIT_NS,
                  semconv.READ_CHUNK_READY_NS, semconv.READ_EXTENT_CHUNK,
                  semconv.READ_EXTENT_START, semconv.READ_EXTENT_END)
LOCATION, THREAD_WINDOW = "location", "thread_window"
SECTOR = 512
_OPEN_END = np.iinfo(np.int64).max


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


def chunk_extents(reads: pd.DataFrame) -> pd.DataFrame:
    """One row per disk extent of a chunk read: key, span (row of `reads`), device,
    first_sector, end_sector, win_start, win_end (win_end int64 max: never finished)."""
    rows = []
    for span, (key, attrs) in enumerate(zip(reads["key"].to_numpy(), reads["attributes"])):
        owners = attrs.get(semconv.READ_EXTENT_CHUNK) or []
        if not owners:
            continue
        submit = attrs.get(semconv.READ_CHUNK_SUBMIT_NS) or []
        ready = attrs.get(semconv.READ_CHUNK_READY_NS) or []
        for chunk, first, end in zip(owners, attrs.get(semconv.READ_EXTENT_START) or [],
                                     attrs.get(semconv.READ_EXTENT_END) or []):
            done = int(ready[chunk]) if chunk < len(ready) else -1
            rows.append((int(key), span, str(attrs.get(semconv.READ_DEVICE, "")), int(first),
                         int(end), int(submit[chunk]) if chunk < len(submit) else 0,
                         done if done >= 0 else _OPEN_END))
    return pd.DataFrame(rows, columns=["key", "span", "device", "first_sector", "end_sector",
                                       "win_start", "win_end"]).astype(
        {c: "int64" for c in ("key", "span", "first_sector", "end_sector", "win_start",
                              "win_end")})


def located(reads: pd.DataFrame) -> np.ndarray:
    """Per storage.read span: whether it says where its chunks lie on disk."""
    return np.array([bool(a.get(semconv.READ_EXTENT_CHUNK)) for a in reads["attributes"]],
                    dtype=bool)


def joinable(reads: pd.DataFrame) -> np.ndarray:
    """Per storage.read span: whether its block reads can be joined (extents or reader tids)."""
    tids = np.array([bool(a.get(semconv.READER_TIDS)) for a in reads["attributes"]], dtype=bool)
    return located(reads) | tids


def join(reads: pd.DataFrame, block_io: pd.DataFrame) -> pd.DataFrame:
    """Block reads matched to a storage.read span's request (JOINED_COLUMNS), indexed by
    their labels in `block_io`.

    `reads`: the storage.read spans with columns key (the request), start_ns, end_ns,
    attributes. Each block read goes to at most one request.
    """
    io = block_io[block_io["op"].astype(str).str.startswith("R")]
    if io.empty or reads.empty:
        return _empty()
    labels = io.index.to_numpy()
    io = io.reset_index(drop=True)
    by_location = _by_location(chunk_extents(reads), io)
    rest = io.drop(index=by_location.index)
    by_thread = _by_thread(reader_windows(reads[~located(reads)]), rest)
    out = pd.concat([by_location, by_thread]).sort_index(kind="stable")
    return out[list(JOINED_COLUMNS)].set_axis(labels[out.index.to_numpy()])


def _by_location(extents: pd.DataFrame, io: pd.DataFrame) -> pd.DataFrame:
    """Joined rows (index: io's) for the block reads that overlap a chunk extent in its window."""
    if extents.empty:
        return _empty()
    pairs = _overlapping(extents, io)
    start = _submitted(io)
    e, r = pairs["extent"].to_numpy(), pairs["read"].to_numpy()
    in_time = ((start[r] <= extents["win_end"].to_numpy()[e])
               & (io["complete_ns"].to_numpy(np.int64)[r] >= extents["win_start"].to_numpy()[e]))
    pairs = pairs[in_time].assign(key=extents["key"].to_numpy()[e[in_time]],
                                  win_start=extents["win_start"].to_numpy()[e[in_time]])
    if pairs.empty:
        return _empty()
    keys = pairs.groupby("read")["key"].nunique()
    chosen = pairs.sort_values(["read", "win_start"], kind="stable").groupby("read").last()
    return _rows(io, chosen.index.to_numpy(), chosen["key"].to_numpy(),
                 (keys[chosen.index] > 1).to_numpy(), LOCATION)


def _overlapping(extents: pd.DataFrame, io: pd.DataFrame) -> pd.DataFrame:
    """(extent, read) positions of every extent and block read on one device whose sectors
    overlap. The extents' boundaries cut the disk into segments; an extent covers some of
    them, a read touches some of them, and the two overlap when they share a segment (extents
    may overlap each other: the same chunk read in several spans)."""
    first = io["sector"].to_numpy(np.int64)
    end = first + -(-io["bytes"].to_numpy(np.int64) // SECTOR)
    found = []
    for device, group in extents.groupby("device", sort=False):
        on_device = np.flatnonzero((io["device"].astype(str) == device).to_numpy())
        if len(on_device) == 0:
            continue
        lo, hi = group["first_sector"].to_numpy(), group["end_sector"].to_numpy()
        bounds = np.unique(np.concatenate([lo, hi]))
        covers = _spread(group.index.to_numpy(), np.searchsorted(bounds, lo),
                         np.searchsorted(bounds, hi), "extent")
        touched = _spread(on_device,
                          np.maximum(np.searchsorted(bounds, first[on_device], "right") - 1, 0),
                          np.searchsorted(bounds, end[on_device], "left"), "read")
        found.append(covers.merge(touched, on="segment")[["extent", "read"]])
    if not found:
        return pd.DataFrame({"extent": [], "read": []}, dtype="int64")
    return pd.concat(found, ignore_index=True).drop_duplicates()


def _spread(ids: np.ndarray, first: np.ndarray, stop: np.ndarray, name: str) -> pd.DataFrame:
    """One row (segment, id) per segment in [first, stop) of each id."""
    n = np.maximum(stop - first, 0)
    return pd.DataFrame({"segment": np.repeat(first, n) + _ranks(n),
                         name: np.repeat(ids, n).astype(np.int64)})


def _ranks(n: np.ndarray) -> np.ndarray:
    """0, 1, ..., n[i] - 1 for each i, concatenated."""
    total = int(n.sum())
    return np.arange(total) - np.repeat(np.cumsum(n) - n, n)


def _by_thread(windows: pd.DataFrame, io: pd.DataFrame) -> pd.DataFrame:
    """Joined rows (index: io's) for block reads submitted by a reader thread of an open span."""
    io = io[io["tid"].astype("int64") >= 0]
    if io.empty or windows.empty:
        return _empty()
    ordered = io.assign(tid=io["tid"].astype("int64"), row=io.index).sort_values(
        "start_ns", kind="stable")
    merged = pd.merge_asof(ordered, windows.sort_values("win_start", kind="stable"),
                           left_on="start_ns", right_on="win_start", by="tid",
                           direction="backward")
    merged = merged[merged["win_end"].notna() & (merged["start_ns"] <= merged["win_end"])]
    return _rows(io, merged["row"].to_numpy(), merged["key"].to_numpy(),
                 merged["overlapped"].astype(bool).to_numpy(), THREAD_WINDOW)


def _submitted(io: pd.DataFrame) -> np.ndarray:
    """When each block read entered the block layer; its issue when submission was not seen."""
    start = io["start_ns"].to_numpy(np.int64)
    return np.where(start >= 0, start, io["issue_ns"].to_numpy(np.int64))


def _rows(io: pd.DataFrame, at: np.ndarray, keys: np.ndarray, ambiguous: np.ndarray,
          method: str) -> pd.DataFrame:
    """JOINED_COLUMNS rows for the block reads labelled `at` in `io` (the labels kept)."""
    picked = io.loc[at]
    start = _submitted(picked)
    return pd.DataFrame({
        "key": keys.astype(np.int64), "start_ns": start,
        "issue_ns": picked["issue_ns"].to_numpy(np.int64),
        "complete_ns": picked["complete_ns"].to_numpy(np.int64),
        "bytes": picked["bytes"].to_numpy(np.int64), "ambiguous": ambiguous.astype(bool),
        "method": method}, index=at)


def _empty() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="bool" if c == "ambiguous" else
                                      "object" if c == "method" else "int64")
                         for c in JOINED_COLUMNS})


def _tid_list(value: Any) -> list[int] | float:
    """Reader tids from the attribute (a list, one int, or a comma string); NaN when absent."""
    if value is None:
        return np.nan
    if isinstance(value, str):
        return [int(v) for v in value.replace(" ", "").split(",") if v] or np.nan
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value] or np.nan
    return [int(value)]
