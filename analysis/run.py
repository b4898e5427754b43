"""Load a run directory into DataFrames, saying what is missing instead of failing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvscope.analysis import otlp, server_requests
from kvscope.contract import rundir
from kvscope.contract.rundir import empty_table

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


def load_run(path: str | Path, *, read_spans: bool = True) -> Run:
    """Read every table and span file of the run at `path` (`read_spans=False`: leave the
    spans empty, for a caller that has them already, as analysis.outputs.load_current).

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
    tables = {name: _table(path, name, problems) for name in rundir.TABLES}
    offset_ns = _offset_ns(manifest, problems)
    files = sorted((path / rundir.SPANS_DIR).glob("*.json")) if read_spans else []
    spans, span_problems = otlp.read_span_files(files, offset_ns)
    problems += span_problems
    if not files and read_spans:
        problems.append(f"{path / rundir.SPANS_DIR}/*.json: no span files (tracer off?); "
                        "TTFT cannot be split into components")
    spans, notes = _clean_spans(spans, problems)
    requests = server_requests.with_server_requests(tables["requests"], spans,
                                                    manifest.get("phases") or [])
    return Run(path, manifest, requests, spans, tables["block_io"],
               tables["queue_depth"], tables["nvme_io"], problems, notes)


def _manifest(path: Path, problems: list[str]) -> dict[str, Any]:
    try:
        return rundir.read_manifest(path)
    except rundir.RunDirError:
        return {}  # validate() already said why


def _table(path: Path, name: str, problems: list[str]) -> pd.DataFrame:
    frame = rundir.read_table(path, name)
    if frame is None:
        if name in _WHY_MISSING:  # validate() reports requests; the other tables are optional
            problems.append(f"{rundir.TABLES[name].file} is missing: {_WHY_MISSING[name]}")
        return empty_table(name)
    if any(c not in frame.columns for c in rundir.TABLES[name].columns):
        return empty_table(name)  # validate() named the missing columns
    return frame


def _offset_ns(manifest: dict[str, Any], problems: list[str]) -> int:
    try:
        return int(manifest["clock"]["offset_ns"])  # an integer in range (MANIFEST_SCHEMA)
    except (KeyError, TypeError, ValueError):
        problems.append("manifest.json has no clock.offset_ns: span times cannot be put on the "
                        "monotonic clock; spans will not line up with requests")
        return 0


def _clean_spans(spans: pd.DataFrame, problems: list[str]) -> tuple[pd.DataFrame, dict]:
    """Fill request ids from the span's trace, drop repeated span ids, note what was wrong."""
    known = spans.dropna(subset=["request_id"]).drop_duplicates("trace_id")
    by_trace = known.set_index("trace_id")["request_id"]
    missing = spans["request_id"].isna()
    spans.loc[missing, "request_id"] = spans.loc[missing, "trace_id"].map(by_trace)
    orphans = int(spans["request_id"].isna().sum())
    if orphans:
        problems.append(f"{orphans} spans carry no kvscope.request_id and share no trace with one "
                        "that does; they are ignored")
    repeated = spans.duplicated(["trace_id", "span_id"], keep="first")
    copies = spans.duplicated(["trace_id", "span_id", "name", "start_ns", "end_ns"], keep="first")
    if copies.any():
        problems.append(f"{int(copies.sum())} spans are exact copies of earlier ones (exported "
                        "twice?); the copies are dropped")
    notes: dict[str, list[str]] = {}
    clashes = repeated & ~copies
    if clashes.any():
        problems.append(f"{int(clashes.sum())} spans reuse a (trace_id, span_id) with different "
                        "contents; the first is kept and their requests are marked partial")
        for rid, count in spans[clashes].groupby("request_id").size().items():
            notes[str(rid)] = [f"{count} spans reuse another span's id; the first was kept"]
    kept = spans[~repeated & spans["request_id"].notna()].reset_index(drop=True)
    return kept, notes
