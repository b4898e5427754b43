"""Attribution of a long run in slices, each small, with the same rows as one pass over the run.

A request's row depends only on its own spans, the block I/O joined to its reads, and what
its worker process ran for other requests inside its window (analysis.batch). So requests
are cut, in arrival order, into slices of at most `slice_requests`; a slice is attributed
(attribution.attribute_tables) over a sub-run that holds:

- every span of its requests, and every span that overlaps [Lo - M, Hi] (Lo, Hi: the
  earliest and latest time of its requests' windows and spans; M: the longest block I/O),
  with every span of those spans' requests too, so each such request's worker process (the
  process of most of its worker spans) and its reads are what they are in the whole run;
- every block I/O that starts inside the sub-run's read spans (the only ones that can join
  one of them).

A block I/O that overlaps a request's window belongs to a read that started before it and
was still open when it started, so that read, and the request that made it, overlap
[Lo - M, Hi]: the worker profile inside each window of the slice is the whole run's. The
rows kept are the slice's own; the others were context. Where reader threads nest a read
inside a longer one, an I/O may join differently than in one pass (docs/analysis.md).

Memory: the slice's spans, I/Os and sweep (about 2 KB per span of the sub-run at peak), on
top of the run's tables as compact columns.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pandas as pd

from kvscope.analysis import parallel, spantable
from kvscope.analysis.attribution import attribute_tables
from kvscope.contract import semconv

SLICE_REQUESTS = 25_000
PARALLEL_REQUESTS = 2 * SLICE_REQUESTS  # smaller runs are attributed in this process alone


def attribute(requests: pd.DataFrame, spans: pd.DataFrame, block_io: pd.DataFrame,
              request_notes: dict[str, list[str]], *, slice_requests: int = SLICE_REQUESTS,
              workers: int | None = None, **options: Any) -> pd.DataFrame:
    """attribution.attribute_tables' rows for the run, computed slice by slice: in `workers`
    processes (default: one per core for a run of PARALLEL_REQUESTS or more, which repays
    starting them: analysis.parallel), each given its slice's sub-run, or in this one."""
    requests = requests.reset_index(drop=True)
    have_block_io = not block_io.empty
    if len(requests) <= slice_requests:
        return attribute_tables(requests, spans, block_io, request_notes,
                                have_block_io=have_block_io, **options)
    cut = _Cutter(requests, spans, block_io)
    cores = cut.slices(slice_requests)
    if workers is None:
        workers = parallel.cores() if len(requests) >= PARALLEL_REQUESTS else 1

    def sub_runs(cut: _Cutter) -> Iterator[tuple[Any, ...]]:
        for core in cores:
            rows, span_rows, io_rows = cut.context(core)
            sub = requests.iloc[rows]
            ids = sub["request_id"].astype(str)
            notes = {rid: request_notes[rid] for rid in ids[ids.isin(list(request_notes))]}
            yield (sub, _own_categories(spans.iloc[span_rows]), block_io.iloc[io_rows], notes,
                   np.isin(rows, core), have_block_io, options)

    pieces = sub_runs(cut)
    del cut  # held by the pieces until the last is cut (not while the rows are joined)
    rows = pd.concat(frame.set_axis(core) for core, frame in  # a slice's own rows: its core
                     zip(cores, parallel.ordered(_slice_rows, pieces, workers)))
    return rows.sort_index().reset_index(drop=True)  # the slices' frames freed by now


def _slice_rows(requests: pd.DataFrame, spans: pd.DataFrame, block_io: pd.DataFrame,
                notes: dict[str, list[str]], keep: np.ndarray, have_block_io: bool,
                options: dict[str, Any]) -> pd.DataFrame:
    """The rows of one slice's own requests (`keep`), attributed over its sub-run."""
    frame = attribute_tables(requests, spans, block_io, notes, have_block_io=have_block_io,
                             **options)
    return frame[keep]


def _own_categories(spans: pd.DataFrame) -> pd.DataFrame:
    """A slice's spans with only its own request ids as categories (mapping a slice's ids is
    then proportional to the slice, not to the run)."""
    if not isinstance(spans["request_id"].dtype, pd.CategoricalDtype):
        return spans
    return spans.assign(request_id=spans["request_id"].cat.remove_unused_categories())


class _Cutter:
    """Index of the run's requests, spans and block I/O by request and by time."""

    def __init__(self, requests: pd.DataFrame, spans: pd.DataFrame, block_io: pd.DataFrame):
        n = len(requests)
        ids = requests["request_id"].astype(str)
        first_row = pd.Series(np.arange(n), index=ids)[~ids.duplicated().to_numpy()]
        self.group = first_row[ids].to_numpy()  # every row -> the first row of its id
        self.span_key = spantable.mapped(spans["request_id"], first_row).fillna(-1).to_numpy(
            np.int64)
        self.start = spans["start_ns"].to_numpy(np.int64)
        self.end = spans["end_ns"].to_numpy(np.int64)
        self.is_read = (spans["name"] == semconv.SPAN_STORAGE_READ).to_numpy()
        arrival = requests["arrival_ns"].to_numpy(np.int64)
        last = np.maximum(requests["first_token_ns"].to_numpy(np.int64), arrival)
        known = self.span_key >= 0
        self.lo, self.hi = arrival.copy(), last.copy()
        np.minimum.at(self.lo, self.span_key[known], self.start[known])
        np.maximum.at(self.hi, self.span_key[known], self.end[known])
        self.arrival = arrival
        self.by_key = np.argsort(self.span_key, kind="stable")
        self.key_bounds = np.searchsorted(self.span_key[self.by_key], np.arange(n + 1))
        self.by_start = np.argsort(self.start, kind="stable")
        self.sorted_start = self.start[self.by_start]
        self.longest_span = int((self.end - self.start).max(initial=0))
        seen = block_io["start_ns"].to_numpy(np.int64) >= 0
        io_start = np.where(seen, block_io["start_ns"].to_numpy(np.int64), -1)
        self.io_order = np.argsort(io_start, kind="stable")
        self.io_sorted = io_start[self.io_order]
        complete = block_io["complete_ns"].to_numpy(np.int64)
        self.longest_io = int((complete - io_start)[seen].max(initial=0))

    def slices(self, size: int) -> list[np.ndarray]:
        """Request rows in arrival order, cut every `size` rows (an id's rows stay together)."""
        order = np.lexsort((np.arange(len(self.group)), self.arrival[self.group]))
        group = self.group[order]
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
        cuts = starts[np.searchsorted(starts, np.arange(size, len(order), size))]
        return [np.sort(part) for part in np.split(order, np.unique(cuts)) if len(part)]

    def context(self, core: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Request rows, span rows and block I/O rows of the sub-run around `core`."""
        keys = np.unique(self.group[core])
        lo = int(self.lo[keys].min()) - self.longest_io
        hi = int(self.hi[keys].max())
        window = self.by_start[np.searchsorted(self.sorted_start, lo - self.longest_span):
                               np.searchsorted(self.sorted_start, hi, side="right")]
        window = window[self.end[window] >= lo]
        near = self.span_key[window]
        keys = np.union1d(keys, near[near >= 0])
        own = [self.by_key[self.key_bounds[k]:self.key_bounds[k + 1]] for k in keys]
        span_rows = np.union1d(np.concatenate([window[near < 0], *own]), [])
        span_rows = span_rows.astype(np.int64)
        rows = np.flatnonzero(np.isin(self.group, keys))
        reads = span_rows[self.is_read[span_rows]]
        if len(reads) == 0:
            return rows, span_rows, np.array([], dtype=np.int64)
        io_rows = self.io_order[np.searchsorted(self.io_sorted, self.start[reads].min()):
                                np.searchsorted(self.io_sorted, self.end[reads].max(),
                                                side="right")]
        return rows, span_rows, np.sort(io_rows)
