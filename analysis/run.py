"""Load a run directory into DataFrames, saying what is missing instead of failing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from kvscope.analysis import server_requests, spantable
from kvscope.contract import rundir
from kvscope.contract.rundir import empty_table

ATTRIBUTION_TABLES = ("requests", "block_io")  # what attribution reads besides the spans
# what a typed load reads of them (the others whole)
_TYPED_COLUMNS = {"block_io": rundir.BLOCK_IO_ANALYSIS_COLUMNS}
_WHY_MISSING = {
    "block_io": "storage read cannot be split into device queue / service / software",
    "queue_depth": "no queue-depth distribution or Little's-law check",
}


@dataclass
class Run:
    """One run directory as DataFrames; every table is present, empty when the run lacks it.

    `spans` times are CLOCK_MONOTONIC ns (OTLP epoch ns minus manifest clock.offset_ns), on
    the same clock as requests.parquet and the probe tables. `requests` also has a row for
    each request seen only in server spans (column `window`: client or server). `problems` lists, readably, what
    is missing or inconsistent; `request_notes` maps a request_id to problems with its spans.
    """

    path: Path
    manifest: dict[str, Any]
    requests: pd.DataFrame
    spans: pd.DataFrame
    block_io: pd.DataFrame
    queue_depth: pd.DataFrame
    nvme_io: pd.DataFrame
    problems: list[str] = field(default_factory=list)
    request_notes: dict[str, list[str]] = field(default_factory=dict)


def load_run(path: str | Path, *, typed: bool = False) -> Run:
    """Read every table and span file of the run at `path` (the spans from RUN/spans.parquet
    while it is current: analysis.spantable). `typed`: the compact form attribution reads:
    spans as spantable.typed_frame (typed attribute columns, no attribute dicts, no ids), and
    of the probe tables only block_io, its columns analysis reads (the others are left
    empty; `read_tables` adds them). Label columns of the probe tables (phase, device, op...)
    are categoricals either way (contract.rundir.read_table).

    Raises:
        FileNotFoundError: `path` is not a directory.
        RunDirError: a file of the run is unreadable or has a field of the wrong type (the
            first such problem, named; `rundir.unreadable` lists them all).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a run directory (it does not exist)")
    rundir.check_readable(path)
    problems = rundir.validate(path)
    manifest = _manifest(path, problems)
    if typed:
        tables = {name: _table(path, name, problems, _TYPED_COLUMNS.get(name))
                  if name in ATTRIBUTION_TABLES else empty_table(name) for name in rundir.TABLES}
    else:
        tables = {name: _table(path, name, problems) for name in rundir.TABLES}
    _give_back_read_buffers()
    offset_ns = _offset_ns(manifest, problems)
    if typed:
        spans, server_spans, meta = spantable.load_typed(path, offset_ns,
                                                         server_requests.SPAN_NAMES)
    else:
        table = spantable.load(path, offset_ns)
        spans = server_spans = spantable.frame(table)
        meta = dict(table.schema.metadata or {})
    _give_back_read_buffers()
    table_meta = spantable.metadata(meta)
    if table_meta is None:  # spantable read it only after checking it: replaced meanwhile
        raise rundir.RunDirError(f"{path / spantable.FILE} changed while being read; "
                                 "analyse the run again")
    notes, problems = table_meta.notes, problems + table_meta.problems
    if not spantable.span_files(path):
        problems.append(f"{path / rundir.SPANS_DIR}/*.json: no span files (tracer off?); "
                        "TTFT cannot be split into components")
    requests = server_requests.with_server_requests(tables["requests"], server_spans,
                                                    manifest.get("phases") or [])
    return Run(path, manifest, requests, spans, tables["block_io"],
               tables["queue_depth"], tables["nvme_io"], problems, notes)


def _give_back_read_buffers() -> None:
    """Hand the memory of a read's transient buffers (pages, decoded columns copied into the
    frames) back to the system: Arrow's allocator keeps what it freed for its next use (1.1 GB
    after reading 10M block I/Os), and what follows a load allocates through numpy, not Arrow."""
    pa.default_memory_pool().release_unused()


def read_tables(run: Run) -> None:
    """Read the tables a typed load left empty into `run` (for the summary after attribution)."""
    for name in rundir.TABLES:
        if name not in ATTRIBUTION_TABLES and hasattr(run, name):
            setattr(run, name, _table(run.path, name, run.problems))


def _manifest(path: Path, problems: list[str]) -> dict[str, Any]:
    try:
        return rundir.read_manifest(path)
    except rundir.RunDirError:
        return {}  # validate() already said why


def _table(path: Path, name: str, problems: list[str],
           columns: tuple[str, ...] | None = None) -> pd.DataFrame:
    """Table `name` (only `columns` of it, when given), empty when the run lacks it or any
    column of its schema."""
    frame = rundir.read_table(path, name, columns)
    if frame is None:
        if name in _WHY_MISSING:  # validate() reports requests; the other tables are optional
            problems.append(f"{rundir.TABLES[name].file} is missing: {_WHY_MISSING[name]}")
        return empty_table(name)
    if any(c not in frame.columns for c in columns or rundir.TABLES[name].columns):
        return empty_table(name)  # validate() named the missing columns
    return frame


def clock_offset_ns(path: Path) -> int:
    """The run's manifest clock.offset_ns (epoch ns - monotonic ns), 0 when it has none."""
    return _offset_ns(_manifest(path, []), [])


def _offset_ns(manifest: dict[str, Any], problems: list[str]) -> int:
    try:
        return int(manifest["clock"]["offset_ns"])  # an integer in range (MANIFEST_SCHEMA)
    except (KeyError, TypeError, ValueError):
        problems.append("manifest.json has no clock.offset_ns: span times cannot be put on the "
                        "monotonic clock; spans will not line up with requests")
        return 0
