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

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvscope.analysis import spantable
from kvscope.contract import semconv

JOINED_COLUMNS = ("key", "start_ns", "issue_ns", "complete_ns", "bytes", "ambiguous", "method")
LOCATION, THREAD_WINDOW = "location", "thread_window"
SECTOR = 512
_OPEN_END = np.iinfo(np.int64).max


def reader_windows(reads: pd.DataFrame) -> pd.DataFrame:
    """One row per (storage.read span, reader tid): key, tid, win_start, win_end, overlapped.

    `reads` has columns key, start_ns, end_ns, and the attributes (an `attributes` dict per
    span, or the span table's typed columns). `overlapped` marks a window that opened while an
    earlier window of the same thread was still open: I/O in it is ambiguous.
    """
    tids, span, _ = _elements(reads, semconv.READER_TIDS)
    known = tids.is_valid().to_numpy(zero_copy_only=False)
    span = span[known]
    windows = pd.DataFrame({"key": reads["key"].to_numpy()[span],
                            "tid": _ints(tids)[known],
                            "win_start": reads["start_ns"].to_numpy()[span],
                            "win_end": reads["end_ns"].to_numpy()[span]})
    windows = windows.sort_values(["tid", "win_start"], kind="stable")
    latest_end = windows.groupby("tid")["win_end"].cummax()
    previous_end = latest_end.groupby(windows["tid"]).shift(1)
    windows["overlapped"] = (windows["win_start"] < previous_end).to_numpy()
    return windows.reset_index(drop=True)


def chunk_extents(reads: pd.DataFrame) -> pd.DataFrame:
    """One row per disk extent of a chunk read: key, span (row of `reads`), device,
    first_sector, end_sector, win_start, win_end (win_end int64 max: never finished).

    A span's extents pair its extent.chunk, extent.start_sector and extent.end_sector arrays
    element by element (as far as the shortest goes); an extent's window is its chunk's
    submit and ready times (0 and open when the chunk arrays are shorter)."""
    chunk, span, position = _elements(reads, semconv.READ_EXTENT_CHUNK)
    first, first_span, _ = _elements(reads, semconv.READ_EXTENT_START)
    end, end_span, _ = _elements(reads, semconv.READ_EXTENT_END)
    n = len(reads)
    pairs = np.minimum.reduce([np.bincount(s, minlength=n) for s in (span, first_span,
                                                                    end_span)])
    kept = position < pairs[span]
    chunk, span, position = _ints(chunk)[kept], span[kept], position[kept]
    at = _starts(first_span, n)[span] + position
    device = spantable.arrow(reads, semconv.READ_DEVICE).cast(pa.string()).fill_null(
        "").to_numpy(zero_copy_only=False)
    done = _element_at(reads, semconv.READ_CHUNK_READY_NS, span, chunk, -1)
    return pd.DataFrame({
        "key": reads["key"].to_numpy(np.int64)[span].astype(np.int64), "span": span,
        "device": device[span].astype(str),
        "first_sector": _ints(first)[at],
        "end_sector": _ints(end)[_starts(end_span, n)[span] + position],
        "win_start": _element_at(reads, semconv.READ_CHUNK_SUBMIT_NS, span, chunk, 0),
        "win_end": np.where(done >= 0, done, _OPEN_END)},
        columns=["key", "span", "device", "first_sector", "end_sector", "win_start",
                 "win_end"])


def _elements(reads: pd.DataFrame, key: str) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """The elements of array attribute `key` of every span, flattened: (the values, the span
    row of each, its position in its span's array)."""
    lists = spantable.arrow(reads, key)
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    span = pc.list_parent_indices(lists).to_numpy().astype(np.int64)
    return pc.list_flatten(lists), span, np.arange(len(span)) - _starts(span, len(reads))[span]


def _ints(values: pa.Array) -> np.ndarray:
    """Integer elements as int64 (a null, which the readers never give an extent, as 0)."""
    return values.fill_null(0).to_numpy().astype(np.int64)


def _starts(span: np.ndarray, n: int) -> np.ndarray:
    """Where each span's elements begin in a flattened array (`span`: the span of each)."""
    return np.concatenate([[0], np.cumsum(np.bincount(span, minlength=n))[:-1]]).astype(
        np.int64)


def _element_at(reads: pd.DataFrame, key: str, span: np.ndarray, index: np.ndarray,
                missing: int) -> np.ndarray:
    """Element `index` (Python's indexing: negative counts from the end) of each `span`'s
    array attribute `key`, `missing` where the array is shorter."""
    values, owner, _ = _elements(reads, key)
    length = np.bincount(owner, minlength=len(reads))[span]
    if (index < -length).any():
        raise IndexError(f"{key}: an extent names a chunk before the first")
    inside = index < length
    at = _starts(owner, len(reads))[span] + np.where(index < 0, index + length, index)
    out = np.full(len(span), missing, dtype=np.int64)
    out[inside] = _ints(values)[at[inside]]
    return out


def located(reads: pd.DataFrame) -> np.ndarray:
    """Per storage.read span: whether it says where its chunks lie on disk."""
    return _non_empty(reads, semconv.READ_EXTENT_CHUNK)


def joinable(reads: pd.DataFrame) -> np.ndarray:
    """Per storage.read span: whether its block reads can be joined (extents or reader tids)."""
    return located(reads) | _non_empty(reads, semconv.READER_TIDS)


def _non_empty(reads: pd.DataFrame, key: str) -> np.ndarray:
    """Per span: array attribute `key` has at least one element."""
    lengths = pc.list_value_length(spantable.arrow(reads, key)).fill_null(0)
    return (lengths.to_numpy() > 0).astype(bool)


def is_read(block_io: pd.DataFrame) -> pd.Series:
    """Per block I/O: whether it reads (its op, the kernel's rwbs flags, starts with R: R, RA,
    RS...); told once per label when op is a categorical (contract.rundir.read_table)."""
    return block_io["op"].str.startswith("R", na=False)


def join(reads: pd.DataFrame, block_io: pd.DataFrame) -> pd.DataFrame:
    """Block reads matched to a storage.read span's request (JOINED_COLUMNS), indexed by
    their labels in `block_io`.

    `reads`: the storage.read spans with columns key (the request), start_ns, end_ns and their
    attributes (dicts or typed columns). Each block read goes to at most one request.
    """
    io = block_io[is_read(block_io)]
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
        on_device = np.flatnonzero((io["device"] == device).to_numpy())
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
