"""Analyse a run and write its outputs into it (attribution.parquet, summary.json, report), and
read them back while they are current, so readers (the dashboard) need not analyse again.

Outputs are current when summary.json carries this analysis version and the fingerprint of
the run's inputs (every producer file's size and mtime, the manifest without its `analysis`
section) that they were made from. `spans.parquet` is the span table (analysis.spantable),
made once: parsing the OTLP files is most of the cost of loading a run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, cast

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvscope.analysis import ledger, report, slices, spantable
from kvscope.analysis.attribution import COLUMNS, attribute
from kvscope.analysis.run import Run, clock_offset_ns, load_run, read_tables
from kvscope.analysis.summary import ANALYSIS_VERSION, SUMMARY_SCHEMA, summarize
from kvscope.contract import files, jsonfiles, rundir

ATTRIBUTION_FILE = "attribution.parquet"
SUMMARY_FILE = "summary.json"
SUMMARY_MAX_BYTES = 256 << 20  # a summary is tens of KB, plus a line per request with notes
SPANS_FILE = spantable.FILE
# attribute()'s columns as analyze writes them: integers (ns, bytes, counts, tokens) but these
_NOT_INTEGERS: dict[str, pa.DataType] = {
    **dict.fromkeys(("request_id", "phase", "window", "diagnostics"), pa.string()),
    "partial": pa.bool_()}
ATTRIBUTION = rundir.TableSpec(ATTRIBUTION_FILE, pa.schema(
    [(c, _NOT_INTEGERS.get(c, pa.int64())) for c in COLUMNS]), "analysis (kvscope analyze)")


def inputs_fingerprint(path: Path) -> str:
    """What the outputs were made from: producer files (size, mtime) and the manifest's body."""
    files = [rundir.table_path(path, name) for name in rundir.TABLES]
    files += sorted((path / rundir.SPANS_DIR).glob("*.json"))
    digest = hashlib.sha256()
    for f in files:
        if f.exists():
            st = f.stat()
            digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    try:
        manifest = rundir.read_manifest(path)
    except rundir.RunDirError:
        manifest = {}
    manifest.pop("analysis", None)
    digest.update(json.dumps(manifest, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


def analyze(path: str | Path, *, plots: bool = True) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Attribute and summarise the run at `path`, write the outputs, return both."""
    path = Path(path)
    run, attribution = attribute_run(path)
    read_tables(run)
    summary = summarize(run, attribution)
    summary["request_notes"] = run.request_notes
    summary["inputs_fingerprint"] = inputs_fingerprint(path)
    with files.atomic_writer(path / ATTRIBUTION_FILE) as f:
        attribution.to_parquet(f, index=False)
    with files.atomic_writer(path / rundir.CHUNK_LEDGER.file) as f:
        ledger.of_run(run).to_parquet(f, index=False)
    files.atomic_write(path / SUMMARY_FILE, json.dumps(summary, indent=2))
    if plots:
        report.write(path, attribution, summary)
    if run.manifest:
        rundir.update_manifest(path, "analysis", {"version": ANALYSIS_VERSION})
    return attribution, summary


def attribute_run(path: str | Path) -> tuple[Run, pd.DataFrame]:
    """The run at `path` (typed spans, from RUN/spans.parquet, made first if it is not
    current) and its attribution, computed in slices (analysis.slices)."""
    path = Path(path)
    if path.is_dir() and spantable.span_files(path):
        rundir.check_readable(path)  # a tampered manifest is refused before any span is read
        spantable.ensure(path, clock_offset_ns(path))
    run = load_run(path, typed=True)
    return run, slices.attribute(run.requests, run.spans, run.block_io, run.request_notes)


def load_attribution(path: str | Path) -> pd.DataFrame:
    """The run's attribution.parquet, computing (not writing) it when it is absent or not an
    attribution (`_output_table`)."""
    path = Path(path)
    attribution = _output_table(path, ATTRIBUTION)
    return attribute(load_run(path)) if attribution is None else attribution


def load_current(path: str | Path) -> tuple[Run, pd.DataFrame, dict[str, Any]] | None:
    """(run, attribution, summary) from the run's analysis outputs when they are current (the
    run's spans from spans.parquet); None when any is missing, stale or not what analysis
    writes (`_output_table`, `_summary`).
    """
    path = Path(path)
    summary = _summary(path)
    if (summary is None or summary["analysis_version"] != ANALYSIS_VERSION
            or summary["inputs_fingerprint"] != inputs_fingerprint(path)):
        return None
    attribution = _output_table(path, ATTRIBUTION)
    if attribution is None:
        return None
    run = load_run(path)  # its spans from RUN/spans.parquet, current with the outputs
    run.problems = list(summary.get("problems", run.problems))
    run.request_notes = {k: list(v) for k, v in summary.get("request_notes", {}).items()}
    return run, attribution, summary


def load_chunk_ledger(path: str | Path) -> pd.DataFrame | None:
    """The run's chunk_ledger.parquet, or None when it is absent or not a chunk ledger."""
    return _output_table(Path(path), rundir.CHUNK_LEDGER)


def _summary(path: Path) -> dict[str, Any] | None:
    """summary.json, or None when it is absent or not of SUMMARY_SCHEMA (as `_output_table`)."""
    file = path / SUMMARY_FILE
    try:
        summary = jsonfiles.parse_json(file, rundir.read_file(file, SUMMARY_MAX_BYTES),
                                       SUMMARY_SCHEMA)
    except (OSError, ValueError):  # RunDirError is a ValueError
        return None
    return cast(dict[str, Any], summary)


def _output_table(path: Path, spec: rundir.TableSpec) -> pd.DataFrame | None:
    """Output table `spec` of the run at `path`, or None when it is absent, not a regular file
    within its cap, not parquet, or lacks a column or has one of another type.

    Outputs are made from the run's inputs and nothing else: a damaged or edited one is taken
    for a stale one, and made again from the inputs, as a missing one is. That is what a user
    expects of a cache (the run still analyses; a half-copied output costs time, not the
    run), where refusing would leave them to find and delete the file by hand; and the
    inputs themselves are read as untrusted, so nothing is lost by not trusting an output."""
    try:
        with rundir.open_file(path / spec.file, rundir.TABLE_MAX_BYTES) as file:
            if rundir.spec_problems(spec, pq.read_schema(file)):
                return None
            return pd.read_parquet(file)
    except (OSError, ValueError, pa.ArrowException):  # RunDirError is a ValueError
        return None
