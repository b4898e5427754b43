"""Hostile variants of a small valid run: `kvscope analyze` and the dashboard either read it or
refuse it in one line (exit 2, DashboardError), never another exception (issue 30).

Each example edits a copy of an analysed run: cells and column types of requests.parquet and
spans.parquet (its metadata kept, so the table is still current and its values are read),
the span table's metadata, fields of summary.json (whose outputs are current) and of the
manifest. Derandomized, so CI tries the same examples each time.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.analysis import outputs
from kvscope.contract import semconv
from kvscope.testkit import synthetic

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                 max_size=3),
    max_leaves=6)
# Values of every kind a parquet cell can hold, in and out of each column's range
CELLS = st.sampled_from([None, 0, -1, 2**63 - 1, -2**63, 2**62, float("nan"), float("inf"),
                         float("-inf"), 1e308, "", "\x00", "<b>x</b>", "a" * 300, True])
RETYPES = st.sampled_from(["string", "float64", "int64", "bool", "null"])
SPAN_COLUMNS = ("name", "start_ns", "end_ns", "request_id", "trace_id", "span_id", "service",
                "pid", semconv.READER_TIDS, semconv.GEN_AI_TTFT, semconv.READ_BYTES,
                semconv.PHASE, semconv.HIT_TOKENS, semconv.LEDGER_START, "attributes")
SPAN_META = ("kvscope.spans.fingerprint", "kvscope.spans.problems", "kvscope.spans.notes")
SUMMARY_KEYS = ("analysis_version", "inputs_fingerprint", "requests", "groups", "throughput",
                "findings", "problems", "request_notes", "chunk_ledger")
MANIFEST_KEYS = ("clock", "phases", "machine", "model", "backend", "run_id", "schema_version",
                 "workload")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small run, analysed: its outputs and span table current."""
    run = synthetic.make_run(tmp_path_factory.mktemp("fuzz") / "run", n_requests=12, seed=11,
                             concurrency=2, phases=("warm", "cold"), nvme=True, ledger=True)
    outputs.analyze(run, plots=False)
    return run


def _set_cell(frame: pd.DataFrame, column: str, row: int, value: Any) -> pd.DataFrame:
    if frame.empty:
        return frame
    series = frame[column].astype(object)
    series.iloc[row % len(series)] = value
    frame[column] = series
    return frame


def _retyped(frame: pd.DataFrame, column: str, kind: str) -> pd.DataFrame:
    if kind == "null":
        frame[column] = pd.Series([None] * len(frame), dtype=object)
        return frame
    try:
        frame[column] = frame[column].astype(kind)
    except (TypeError, ValueError, OverflowError):
        frame[column] = frame[column].astype(str)
    return frame


def _write_frame(frame: pd.DataFrame, path: Path, schema: pa.Schema) -> None:
    """`frame` as parquet: of `schema` (the file's own, its footer metadata kept: a span table
    stays current) where its values fit, else of the types Arrow finds, else as strings."""
    for convert in (lambda: pa.Table.from_pandas(frame, schema=schema, preserve_index=False),
                    lambda: pa.Table.from_pandas(frame, preserve_index=False),
                    lambda: pa.Table.from_pandas(frame.astype(str), preserve_index=False)):
        try:
            table = convert()
            break
        except (pa.ArrowException, KeyError, TypeError, ValueError, OverflowError):
            continue
    metadata = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()
                if k not in (b"ARROW:schema", b"pandas")}
    with pq.ParquetWriter(path, table.schema.remove_metadata()) as writer:
        writer.write_table(table.replace_schema_metadata(None))
        if metadata:
            writer.add_key_value_metadata(metadata)


def _edit_table(path: Path, edit: Callable[[pd.DataFrame], pd.DataFrame]) -> None:
    parquet = pq.ParquetFile(path)
    footer = parquet.metadata.metadata or {}
    _write_frame(edit(parquet.read().to_pandas()), path,
                 parquet.schema_arrow.with_metadata(footer))


def _edit_json(path: Path, key: str, value: Any) -> None:
    document = json.loads(path.read_text())
    document[key] = value
    path.write_text(json.dumps(document))


def _edit_span_meta(path: Path, key: str, text: str) -> None:
    parquet = pq.ParquetFile(path)
    metadata = {k: v for k, v in (parquet.metadata.metadata or {}).items()
                if k != b"ARROW:schema"}
    metadata[key.encode()] = text.encode("utf-8", "surrogatepass")
    table = parquet.read().replace_schema_metadata(None)
    with pq.ParquetWriter(path, table.schema) as writer:
        writer.write_table(table)
        writer.add_key_value_metadata({k.decode(): v.decode("utf-8", "replace")
                                       for k, v in metadata.items()})


def _apply(run: Path, edit: tuple[Any, ...]) -> None:
    """Make one edit (a tuple: its kind, then its arguments) on the run; an edit of a file an
    earlier edit made garbage leaves it so."""
    with contextlib.suppress(pa.ArrowException, ValueError):
        _edit(run, edit)


def _edit(run: Path, edit: tuple[Any, ...]) -> None:
    kind, *args = edit
    if kind == "garbage":
        name, data = args
        (run / name).write_bytes(data)
    elif kind in ("summary", "manifest"):
        _edit_json(run / f"{kind}.json", *args)
    elif kind == "span-meta":
        _edit_span_meta(run / "spans.parquet", *args)
    else:
        table, change, column, *rest = args
        _edit_table(run / table, lambda f: _TABLE_EDITS[change](f, _column(f, column), *rest))


def _column(frame: pd.DataFrame, column: int | str) -> str:
    """The column named, when the table has it, else one chosen by the number."""
    if column in frame.columns:
        return str(column)
    return str(frame.columns[(column if isinstance(column, int) else len(column))
                             % len(frame.columns)])


_TABLE_EDITS: dict[str, Callable[..., pd.DataFrame]] = {
    "cell": _set_cell, "retype": _retyped,
    "drop": lambda f, column: f.drop(columns=column),
    "no-rows": lambda f, column: f.iloc[0:0],
    "twice": lambda f, column: pd.concat([f, f], ignore_index=True),
}
TABLE = st.sampled_from(["requests.parquet", "spans.parquet"])
COLUMN = st.integers(0, 60) | st.sampled_from(SPAN_COLUMNS)
EDITS = st.one_of(
    st.tuples(st.just("table"), TABLE, st.just("cell"), COLUMN, st.integers(0, 400), CELLS),
    st.tuples(st.just("table"), TABLE, st.just("retype"), COLUMN, RETYPES),
    st.tuples(st.just("table"), TABLE, st.sampled_from(["drop", "no-rows", "twice"]), COLUMN),
    st.tuples(st.just("span-meta"), st.sampled_from(SPAN_META),
              JSON.map(json.dumps) | st.text(max_size=8)),
    st.tuples(st.just("summary"), st.sampled_from(SUMMARY_KEYS), JSON),
    st.tuples(st.just("manifest"), st.sampled_from(MANIFEST_KEYS), JSON),
    st.tuples(st.just("garbage"), st.sampled_from([
        "requests.parquet", "spans.parquet", "summary.json", "attribution.parquet",
        "chunk_ledger.parquet", "block_io.parquet"]),
        st.binary(max_size=16).map(lambda b: b"PAR1" + b + b"PAR1")),
)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(edits=st.lists(EDITS, min_size=1, max_size=3))
def test_a_hostile_run_is_read_or_refused_in_one_line(analysed, tmp_path, edits):
    from kvscope.cli import main
    from kvscope.dashboards import callbacks, data

    run = tmp_path / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(analysed, run)
    for edit in edits:
        _apply(run, edit)
    try:
        loaded = data.load_runs([run])
    except data.DashboardError as e:
        assert "\n" not in str(e), e
    else:
        callbacks.update_summary_views(loaded, list(loaded), None)
        data.chunk_tally_of(loaded, list(loaded))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["analyze", str(run), "--no-plots"])
    assert code in (0, 2), err.getvalue()
    if code == 2:
        assert err.getvalue().count("\n") == 1, err.getvalue()
