"""OTLP JSON span files -> the cleaned span table (contract.spantable), file by file.

Each file is read on its own: from the Parquet part the tracer wrote of it while that is
current (`part_rows`), else parsed (analysis.otlp_fast, or protobuf for a document it gives
back; in a worker process per core when the files without parts are big: analysis.parallel),
and its rows appended to the Parquet output in row groups of ROW_GROUP rows; cleaning
(analysis.spanclean) keeps 8 bytes a span meanwhile. When the spans need no cleaning (every
span names its request, no id repeats: what the tracer writes) that output is the table;
otherwise (some span lacks a request id, or two spans' id hashes agree) it is read back one
row group at a time and written again without the dropped rows and with the filled request
ids. The table's metadata (the problems found, the per-request notes, what the caller adds)
goes into the Parquet file's key-value metadata, written last.

Memory: one span file's document and rows (and its part's bytes, at most PART_MAX_BYTES; a
few per worker when parsed in parallel), one
row group (about 200 bytes a span as Arrow columns before compression, 50 MB at ROW_GROUP),
and 8 bytes a span of hashes (80 MB at 10M spans), plus an argsort of those at the end;
never the run's table.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvscope.analysis import otlp, otlp_fast, parallel, spanclean
from kvscope.contract import files, rundir, semconv
from kvscope.contract import spantable as spec

ROW_GROUP = 1 << 18
PARALLEL_BYTES = 256 << 20  # span files smaller in all are parsed in this process


class Target(Protocol):
    """Where a table is written, and read back from for the cleaning pass."""

    def open(self) -> Any:
        """A context manager giving a binary sink that replaces the target when it closes."""

    def source(self) -> Any:
        """What ParquetFile reads the last closed sink's table from."""


class FileTarget:
    """A Parquet file in a run directory, written through contract.files.atomic_writer."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self) -> Any:
        return files.atomic_writer(self.path)

    def source(self) -> Any:
        return self.path


class MemoryTarget:
    """A Parquet file in memory (a table made for one reader, not kept)."""

    def __init__(self) -> None:
        self._buffer: pa.Buffer | None = None

    @contextmanager
    def open(self) -> Iterator[pa.BufferOutputStream]:
        sink = pa.BufferOutputStream()
        yield sink
        self._buffer = sink.getvalue()

    def source(self) -> Any:
        return pa.BufferReader(self._buffer)


def write(span_files: Iterable[Path], offset_ns: int, target: Target,
          metadata: dict[bytes, Any]) -> None:
    """The cleaned span table of `span_files` (epoch ns minus `offset_ns`), with `metadata`
    and the problems and notes found (contract.spantable META_*), written to `target`."""
    keys = spanclean.Keys()
    problems: list[str] = []
    # the writer closes before its sink, also when a span file is refused (the sink then
    # discards what was written)
    with target.open() as sink, pq.ParquetWriter(sink, spec.SCHEMA) as writer:
        pending = _Pending(writer)
        paths = list(span_files)
        for batch, bad in parallel.ordered(file_rows, [(f, offset_ns) for f in paths],
                                           _workers(paths)):
            problems += bad
            if batch.num_rows:
                keys.add(batch)
                pending.add(batch)
        pending.flush()
        clean = not keys.suspect()
        if clean:
            writer.add_key_value_metadata(_encoded(
                {**metadata, spec.META_PROBLEMS: problems, spec.META_NOTES: {}}))
    if not clean:
        cleaning = keys.decide(_reader(pending.sizes, target), _scanner(target))
        _rewrite(target, pending.sizes, cleaning,
                 {**metadata, spec.META_PROBLEMS: problems + cleaning.problems,
                  spec.META_NOTES: cleaning.notes})


def _workers(span_files: list[Path]) -> int:
    """Processes to parse with: one per core when the files are big enough to repay starting
    them (parsing is most of the conversion's CPU, and each file parses on its own; this
    process hashes and writes meanwhile), else this one."""
    unparted = [f for f in span_files if not spec.part_of(f).exists()]  # a part is quick
    if sum(f.lstat().st_size for f in unparted) < PARALLEL_BYTES:  # a link is refused
        return 1
    return min(parallel.cores(), len(span_files))


def file_rows(path: Path, offset_ns: int) -> tuple[pa.RecordBatch, list[str]]:
    """One span file's rows of the table and its problems: its part's while current
    (`part_rows`), else the fast reader's, or protobuf's for a document the fast reader gives
    back. RunDirError, naming the file and the field, for a file that is not a regular file
    within rundir.SPAN_FILE_MAX_BYTES or whose values the table cannot hold (`check_values`)."""
    document = rundir.read_file(path, rundir.SPAN_FILE_MAX_BYTES)
    batch = part_rows(path, document, offset_ns)
    bad: list[str] = []
    if batch is None:
        batch, bad = _parsed(path, document, offset_ns)
    problem = check_values(batch)
    if problem:
        raise rundir.RunDirError(f"{path}: {problem}; fix or remove the file")
    return batch, bad


def _parsed(path: Path, document: bytes, offset_ns: int) -> tuple[pa.RecordBatch, list[str]]:
    """The rows and problems of span file `path` (bytes `document`), parsed."""
    batch = otlp_fast.batch(document, offset_ns)
    if batch is not None:
        return batch, []
    rows, bad = otlp.document_rows(path, document, offset_ns)
    return spec.rows_batch(rows), bad


# A part is smaller than its span file (Parquet of the same rows), whose cap it shares.
PART_MAX_BYTES = rundir.SPAN_FILE_MAX_BYTES
_PART_FILLED = [name for name in spec.FILLED if name != "request_id"]  # cleaning fills that


def part_rows(path: Path, document: bytes, offset_ns: int) -> pa.RecordBatch | None:
    """The rows of span file `path` (bytes `document`) from the part the tracer wrote of it
    (contract.spantable.part_of), times minus `offset_ns`. None, and the file is parsed, when
    the part is missing; not a regular file of this user (or root) within PART_MAX_BYTES (its
    rows are taken as the file's unchecked, so only a part of ours is: one planted by another
    user, a link, a FIFO are never opened); not Parquet of the table's schema; made of another
    file or of this one as it was (META_SOURCE: name, size, SHA-256); holding a null where a
    span has a value; or with a time the offset takes past int64 (the parser then says so)."""
    try:
        # read whole (Arrow reads a Python file object at half the speed)
        parquet = pq.ParquetFile(pa.BufferReader(files.read_bytes(spec.part_of(path),
                                                                  PART_MAX_BYTES)))
        meta = parquet.metadata.metadata or {}
        if meta.get(spec.META_SOURCE) != spec.part_source(path, document) or \
                not parquet.schema_arrow.remove_metadata().equals(spec.SCHEMA):
            return None
        rows = parquet.read().replace_schema_metadata(None)
        if any(rows[name].null_count for name in _PART_FILLED):
            return None
        for name in ("start_ns", "end_ns"):
            rows = rows.set_column(rows.schema.get_field_index(name), name,
                                   pc.subtract_checked(rows[name], offset_ns))
    except (OSError, ValueError, pa.ArrowException):  # UnsafePath is a ValueError
        return None
    batches = rows.combine_chunks().to_batches()
    return batches[0] if len(batches) == 1 else None  # the tracer writes no empty part


MAX_TTFT_S = 1e9  # a server's TTFT (s) the table takes: its ns fit int64 (analysis.server_requests)


def check_values(batch: pa.RecordBatch) -> str | None:
    """What in a span file's rows analysis could not compute with (a NaN, infinite or
    absurd server TTFT, which becomes integer ns), or None."""
    ttft = batch.column(semconv.GEN_AI_TTFT).fill_null(0.0).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(~(np.abs(ttft) < MAX_TTFT_S))  # NaN compares false
    if not len(bad):
        return None
    first = int(bad[0])
    return (f"span {batch.column('name')[first].as_py()!r}: {semconv.GEN_AI_TTFT} is "
            f"{ttft[first]}, not a number of seconds within ±{MAX_TTFT_S:.0e}")


class _Pending:
    """Record batches gathered into row groups of ROW_GROUP rows as they are written."""

    def __init__(self, writer: pq.ParquetWriter) -> None:
        self.writer = writer
        self.batches: list[pa.RecordBatch] = []
        self.rows = 0
        self.sizes: list[int] = []  # rows of each row group written

    def add(self, batch: pa.RecordBatch) -> None:
        self.batches.append(batch)
        self.rows += batch.num_rows
        if self.rows < ROW_GROUP:
            return
        table = pa.Table.from_batches(self.batches)
        full = self.rows // ROW_GROUP * ROW_GROUP
        for start in range(0, full, ROW_GROUP):
            self._group(table.slice(start, ROW_GROUP))
        rest = table.slice(full)
        self.batches, self.rows = rest.to_batches(), rest.num_rows

    def flush(self) -> None:
        if self.rows:
            self._group(pa.Table.from_batches(self.batches))
        self.batches, self.rows = [], 0

    def _group(self, table: pa.Table) -> None:
        self.writer.write_table(table, row_group_size=table.num_rows)
        self.sizes.append(table.num_rows)


def _reader(sizes: list[int], target: Target) -> spanclean.ReadRows:
    def read_rows(rows: np.ndarray, columns: list[str]) -> pa.Table:
        """`columns` of the given global rows (sorted) of the table written to `target`."""
        file = pq.ParquetFile(target.source())
        starts = np.cumsum([0, *sizes])
        group = np.searchsorted(starts, rows, side="right") - 1
        parts = []
        for g in np.unique(group).tolist():
            local = rows[group == g] - starts[g]
            parts.append(file.read_row_group(g, columns=columns).take(pa.array(local)))
        return pa.concat_tables(parts)
    return read_rows


def _scanner(target: Target) -> spanclean.Scan:
    def scan(columns: list[str]) -> Iterator[pa.Table]:
        """`columns` of the table written to `target`, one row group at a time."""
        file = pq.ParquetFile(target.source())
        for g in range(file.num_row_groups):
            yield file.read_row_group(g, columns=columns)
    return scan


def _rewrite(target: Target, sizes: list[int], cleaning: spanclean.Cleaning,
             meta: dict[bytes, Any]) -> None:
    """The table at `target` again, one row group at a time, cleaned as `cleaning` says."""
    source = pq.ParquetFile(target.source())
    column = spec.SCHEMA.get_field_index("request_id")
    start = 0
    with target.open() as sink, pq.ParquetWriter(sink, spec.SCHEMA) as writer:
        for g, size in enumerate(sizes):
            table = source.read_row_group(g)
            lo, hi = np.searchsorted(cleaning.fill_rows, [start, start + size])
            at = np.full(size, -1, dtype=np.int64)
            at[cleaning.fill_rows[lo:hi] - start] = np.arange(lo, hi)
            filled = otlp_fast.gather(cleaning.fill_ids, at)
            table = table.set_column(column, "request_id",
                                     pc.coalesce(table["request_id"].combine_chunks(), filled))
            keep = np.ones(size, dtype=bool)
            d0, d1 = np.searchsorted(cleaning.drop, [start, start + size])
            keep[cleaning.drop[d0:d1] - start] = False
            writer.write_table(table.filter(pa.array(keep)), row_group_size=size)
            start += size
        writer.add_key_value_metadata(_encoded(meta))


def _encoded(meta: dict[bytes, Any]) -> dict[str, str]:
    """Footer key-value pairs: the keys as given, the values as JSON text."""
    return {k.decode(): json.dumps(v) for k, v in meta.items()}
