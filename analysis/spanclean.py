"""What cleaning a span table takes, decided from a few bytes a span instead of the table.

A run's spans are cleaned as they always were: a span without kvscope.request_id takes the
request id of the first span of its trace that has one (else it is ignored), a span that
repeats an earlier span's (trace_id, span_id) is dropped (an exact copy silently but for a
problem line; one with other contents marks its request partial). The table is written batch
by batch (analysis.spanstream), so `Keys` keeps only, per span, a 64-bit hash of its
(trace_id, span_id), and the trace ids of the spans that lack a request id. At the end, spans
whose hash repeats (true repeats, or a hash collision) are read back in full and decided
exactly, as are the orphans' traces; `Cleaning` says which rows to drop or fill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvscope.contract import spantable as spec

_NIBBLE = np.zeros(256, dtype=np.uint64)
_NIBBLE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint64)
_SHIFTS = np.arange(60, -1, -4, dtype=np.uint64)  # a 16-digit word's nibbles, high first
_MIX = tuple(np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB,
                                    0xD6E8FEB86659FD93))
# Reads the columns of the given global rows of the written table: (rows, columns) -> table
ReadRows = Callable[[np.ndarray, list[str]], pa.Table]
# Scans the written table's columns batch by batch: columns -> iterator of tables
Scan = Callable[[list[str]], Any]
KEY_COLUMNS = [*spec.COPY_COLUMNS, "request_id"]  # what deciding a suspect row reads
_KNOWN = pa.schema([("trace_id", pa.string()), ("request_id", pa.string())])


@dataclass
class Cleaning:
    """What the written table needs: rows to drop, request ids to fill, what to say."""

    drop: np.ndarray  # sorted global rows to leave out
    fill_rows: np.ndarray  # sorted global rows whose request id is taken from their trace
    fill_ids: pa.Array  # the request id of each of fill_rows
    problems: list[str] = field(default_factory=list)
    notes: dict[str, list[str]] = field(default_factory=dict)


class Keys:
    """Per span, what cleaning needs, gathered batch by batch: 8 bytes a span (the hash of its
    trace and span id), plus the trace id of each span without a request id."""

    def __init__(self) -> None:
        self._hashes: list[np.ndarray] = []
        self._orphan_rows: list[np.ndarray] = []
        self._orphan_traces: list[pa.Array] = []
        self._shared: np.ndarray | None = None  # rows whose hash another row has, once known
        self.rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        trace, span = batch.column("trace_id"), batch.column("span_id")
        words = np.concatenate([_hex_words(trace, 32), _hex_words(span, 16)], axis=1)
        self._hashes.append(_hash(words))
        orphans = np.flatnonzero(batch.column("request_id").is_null().to_numpy(
            zero_copy_only=False))
        if len(orphans):
            self._orphan_rows.append(orphans + self.rows)
            self._orphan_traces.append(trace.take(orphans))
        self.rows += batch.num_rows

    def suspect(self) -> bool:
        """Whether the table may need cleaning: a span lacks a request id, or two spans'
        (trace_id, span_id) hash alike (the same ids, or rarely a collision)."""
        return bool(self._orphan_rows) or len(self._shared_rows()) > 0

    def _shared_rows(self) -> np.ndarray:
        """The rows whose hash another row has, sorted."""
        if self._shared is None:
            hashes = (np.concatenate(self._hashes) if self._hashes
                      else np.zeros(0, dtype=np.uint64))
            self._hashes = []
            order = np.argsort(hashes, kind="stable")
            ordered = hashes[order]
            same = ordered[1:] == ordered[:-1]
            shared = np.zeros(len(hashes), dtype=bool)
            shared[1:] |= same
            shared[:-1] |= same
            self._shared = np.sort(order[shared])
        return self._shared

    def decide(self, read_rows: ReadRows, scan: Scan) -> Cleaning:
        """The cleaning of the table written so far, reading back what the keys cannot say."""
        fill_rows, fill_ids, orphans = self._fills(scan)
        repeated, copies, clashing = self._repeats(read_rows, fill_rows, fill_ids)
        problems = []
        if orphans:
            problems.append(f"{orphans} spans carry no kvscope.request_id and share no trace "
                            "with one that does; they are ignored")
        if len(copies):
            problems.append(f"{len(copies)} spans are exact copies of earlier ones (exported "
                            "twice?); the copies are dropped")
        notes: dict[str, list[str]] = {}
        if len(clashing):
            problems.append(f"{len(clashing)} spans reuse a (trace_id, span_id) with different "
                            "contents; the first is kept and their requests are marked partial")
            for request, count in clashing.groupby(clashing).size().items():
                notes[str(request)] = [f"{count} spans reuse another span's id; the first was "
                                       "kept"]
        unfilled = np.setdiff1d(self._orphans(), fill_rows)
        drop = np.union1d(repeated, unfilled).astype(np.int64)
        return Cleaning(drop, fill_rows, fill_ids, problems, notes)

    def _orphans(self) -> np.ndarray:
        return (np.concatenate(self._orphan_rows) if self._orphan_rows
                else np.zeros(0, dtype=np.int64))

    def _fills(self, scan: Scan) -> tuple[np.ndarray, pa.Array, int]:
        """(orphan rows that their trace gives a request id, those ids, orphans left). Typed
        string columns throughout: a trace where no span has a request id gives a null id,
        never a column of another type."""
        rows = self._orphans()
        if not len(rows):
            return rows, pa.array([], pa.string()), 0
        traces = pa.chunked_array(self._orphan_traces, pa.string()).combine_chunks()
        wanted = pc.unique(traces)
        found = [_KNOWN.empty_table()]
        for part in scan(["trace_id", "request_id"]):
            hit = pc.and_(pc.is_in(part["trace_id"], value_set=wanted),
                          pc.is_valid(part["request_id"]))
            found.append(part.filter(hit).cast(_KNOWN))
        known = pa.concat_tables(found)
        # each orphan's trace's first row with a request id (index_in finds the first)
        at = pc.index_in(traces, value_set=known["trace_id"].combine_chunks())
        ids = known["request_id"].combine_chunks().take(at)
        filled = ids.is_valid()
        return rows[filled.to_numpy(zero_copy_only=False)], ids.filter(filled), ids.null_count

    def _repeats(self, read_rows: ReadRows, fill_rows: np.ndarray, fill_ids: pa.Array
                 ) -> tuple[np.ndarray, np.ndarray, pd.Series]:
        """(rows repeating an earlier (trace_id, span_id), the exact copies among them, the
        request id of each clashing one), the few rows whose hash repeats read back in full."""
        rows = self._shared_rows()
        if not len(rows):
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, pd.Series([], dtype=object)
        frame = read_rows(rows, KEY_COLUMNS).to_pandas()
        filled = pd.Series(fill_ids.to_numpy(zero_copy_only=False), index=fill_rows)
        frame["request_id"] = frame["request_id"].fillna(pd.Series(rows).map(filled))
        repeated = frame.duplicated(list(spec.SPAN_IDENTITY)).to_numpy()
        copies = frame.duplicated(list(spec.COPY_COLUMNS)).to_numpy()
        clashes = repeated & ~copies
        return rows[repeated], rows[copies], frame["request_id"][clashes]


def _hex_words(ids: pa.Array, width: int) -> np.ndarray:
    """Lower-case hex ids of `width` characters (the table's: otlp_json and the fast reader
    refuse any other required id) as width/16 uint64 words each."""
    ids = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    n = len(ids)
    if n == 0:
        return np.zeros((0, width // 16), dtype=np.uint64)
    offsets = np.frombuffer(_buffer(ids, 1), np.int32, n + 1, ids.offset * 4)
    if not (np.diff(offsets) == width).all():
        raise ValueError(f"span table ids must be {width} hex characters")
    data = np.frombuffer(_buffer(ids, 2), np.uint8)
    chars = data[offsets[0]:offsets[-1]].reshape(n, width // 16, 16)
    return (_NIBBLE[chars] << _SHIFTS).sum(axis=2, dtype=np.uint64)


def _buffer(array: pa.Array, i: int) -> memoryview:
    """Buffer `i` of a string array (1: offsets, 2: characters), which it always has."""
    buffer = array.buffers()[i]
    if buffer is None:
        raise ValueError("a string array without offsets or characters")
    return memoryview(buffer)


def _hash(words: np.ndarray) -> np.ndarray:
    """A 64-bit hash per row of uint64 words (splitmix64's finaliser over a weighted sum)."""
    x = np.zeros(len(words), dtype=np.uint64)
    for i in range(words.shape[1]):
        x = (x ^ words[:, i]) * _MIX[i % 2]
        x ^= x >> np.uint64(31)
    x *= _MIX[2]
    x ^= x >> np.uint64(29)
    x *= _MIX[3]
    return x ^ (x >> np.uint64(32))
