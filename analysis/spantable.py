"""A run's spans as one columnar table (contract.spantable), made once and read from then on.

Parsing OTLP JSON is most of the cost of loading a run (about 120 us per span through
protobuf); the table is made once, with the fast reader (analysis.otlp_fast) and protobuf
for any document it gives back, cleaned (request ids filled from the trace, repeated span
ids dropped) and cached as RUN/spans.parquet with the fingerprint of the span files and clock
it came from. Analysis reads only the columns it needs from it, typed, with no per-span
Python objects; `frame` gives the classic frame with an attribute dict per span.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Iterable

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvscope.analysis import otlp, otlp_fast
from kvscope.contract import files, rundir
from kvscope.contract import spantable as spec
from kvscope.contract import semconv
from kvscope.contract.semconv import SPAN_COLUMNS

FILE = "spans.parquet"
FORMAT = "2"  # bump when the table's meaning changes: older caches are then rebuilt
ROW_GROUP = 1 << 20
def span_files(run: Path) -> list[Path]:
    return sorted((Path(run) / rundir.SPANS_DIR).glob("*.json"))


def fingerprint(run: Path, offset_ns: int) -> str:
    """What the table is made from: each span file's name, size and mtime, and the clock."""
    digest = hashlib.sha256(f"{FORMAT};{offset_ns};".encode())
    for f in span_files(run):
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return digest.hexdigest()[:32]


def build(files_: Iterable[Path], offset_ns: int) -> pa.Table:
    """The cleaned span table of the OTLP JSON files (problems in its metadata)."""
    batches, problems = [], []
    for path in files_:
        rows = otlp_fast.rows(path.read_bytes(), offset_ns)
        if rows is None:
            rows, bad = otlp.read_rows(path, offset_ns)
            problems += bad
        if rows:
            batches.append(_batch(rows))
    table = pa.Table.from_batches(batches, schema=spec.SCHEMA)
    table, clean_problems, notes = _clean(table)
    return _with_meta(table, {spec.META_PROBLEMS: problems + clean_problems,
                              spec.META_NOTES: notes})


def load(run: Path, offset_ns: int) -> pa.Table:
    """The run's span table: RUN/spans.parquet while current, else made now (not written)."""
    path = _current(Path(run), offset_ns)
    return pq.read_table(path) if path else build(span_files(run), offset_ns)


def load_typed(run: Path, offset_ns: int, names: tuple[str, ...]
               ) -> tuple[pd.DataFrame, pd.DataFrame, dict[bytes, Any]]:
    """(typed_frame of every span, typed_frame of the spans named `names` with their
    trace_id, the table's metadata), reading from spans.parquet only the columns that hold
    anything (a typed column no span has is never read)."""
    path = _current(Path(run), offset_ns)
    table = pq.read_table(path, columns=[]) if path else build(span_files(run), offset_ns)
    columns = [*spec.ANALYSIS_COLUMNS, *_holding(path, table)]
    named = pc.field("name").isin(list(names))
    if path:
        every = pq.read_table(path, columns=columns)
        some = pq.read_table(path, columns=[*columns, "trace_id"], filters=named)
    else:
        every = table.select(columns)
        some = table.filter(named).select([*columns, "trace_id"])
    chosen = typed_frame(some).assign(trace_id=some["trace_id"].to_pandas())
    return typed_frame(every), chosen, dict(table.schema.metadata or {})


def _holding(path: Path | None, table: pa.Table) -> list[str]:
    """The typed attribute columns some span has a value in (from the file's statistics)."""
    if path is None:
        return [k for k in spec.TYPED_ATTRIBUTES if table[k].null_count < len(table)]
    file = pq.ParquetFile(path)
    meta_ = file.metadata
    names = file.schema_arrow.names  # one leaf each: the table has no nested columns
    holding = set()
    for g in range(meta_.num_row_groups):
        group = meta_.row_group(g)
        for i, name in enumerate(names):
            stats = group.column(i).statistics
            nulls = stats.null_count if stats is not None else None
            if nulls is None or nulls < group.num_rows:
                holding.add(name)
    return [k for k in spec.TYPED_ATTRIBUTES if k in holding]


def ensure(run: Path, offset_ns: int) -> Path:
    """Write RUN/spans.parquet unless it is current; its path."""
    path = Path(run) / FILE
    if _current(Path(run), offset_ns) is None:
        table = build(span_files(run), offset_ns)
        table = _with_meta(table, {spec.META_FINGERPRINT: fingerprint(run, offset_ns)})
        with files.atomic_writer(path) as f:
            pq.write_table(table, f, row_group_size=ROW_GROUP)
    return path


def _current(run: Path, offset_ns: int) -> Path | None:
    """RUN/spans.parquet when it was made from the run's span files as they are now."""
    path = run / FILE
    try:
        meta_ = pq.read_schema(path).metadata or {}
    except (OSError, ValueError, pa.ArrowInvalid):
        return None
    made_from = json.loads(meta_.get(spec.META_FINGERPRINT, b"null"))
    return path if made_from == fingerprint(run, offset_ns) else None


def meta(table: pa.Table, key: bytes) -> Any:
    return json.loads((table.schema.metadata or {}).get(key, b"null"))


def _with_meta(table: pa.Table, values: dict[bytes, Any]) -> pa.Table:
    merged = dict(table.schema.metadata or {})
    merged.update({k: json.dumps(v).encode() for k, v in values.items()})
    return table.replace_schema_metadata(merged)


def _batch(rows: list[tuple]) -> pa.RecordBatch:
    """Rows of analysis.otlp (attributes as dicts) as one record batch of the table."""
    columns: dict[str, list[Any]] = {name: [] for name in ("service", "pid", spec.REST)}
    typed: dict[str, list[Any]] = {key: [None] * len(rows) for key in spec.TYPED_ATTRIBUTES}
    for i, row in enumerate(rows):
        rest = {}
        for key, value in row[7].items():
            if key in typed:  # of its declared type: otlp_json made sure
                typed[key][i] = value
            else:
                rest[key] = value
        columns["service"].append(row[8])
        columns["pid"].append(row[9])
        columns[spec.REST].append(_json(rest))
    base = list(zip(*rows))[:7]  # the row's values before its attributes
    arrays: dict[str, Any] = {name: values for (name, _), values in zip(spec.SPAN_FIELDS, base)}
    arrays.update(columns)
    arrays.update(typed)
    return pa.RecordBatch.from_pydict(arrays, schema=spec.SCHEMA)


_ENCODE = msgspec.json.Encoder()


def _json(rest: dict[str, Any]) -> str:
    if not rest:
        return ""
    if otlp_fast.finite(rest):
        return _ENCODE.encode(rest).decode()
    return json.dumps(rest, default=str)  # NaN / Infinity, which msgspec writes as null


def _clean(table: pa.Table) -> tuple[pa.Table, list[str], dict[str, list[str]]]:
    """Fill request ids from the span's trace, drop repeated span ids, say what was wrong."""
    problems: list[str] = []
    rid = table["request_id"]
    known = table.filter(pc.is_valid(rid)).select(["trace_id", "request_id"])
    first = known.group_by("trace_id", use_threads=False).aggregate([("request_id", "first")])
    at = pc.index_in(table["trace_id"], value_set=first["trace_id"].combine_chunks())
    rid = pc.coalesce(rid, pc.take(first["request_id_first"], at))
    table = table.set_column(table.schema.get_field_index("request_id"), "request_id", rid)
    orphans = rid.null_count
    if orphans:
        problems.append(f"{orphans} spans carry no kvscope.request_id and share no trace with one "
                        "that does; they are ignored")
    repeated = ~_first_of(table, ["trace_id", "span_id"])
    copies = ~_first_of(table, ["trace_id", "span_id", "name", "start_ns", "end_ns"])
    if copies.any():
        problems.append(f"{int(copies.sum())} spans are exact copies of earlier ones (exported "
                        "twice?); the copies are dropped")
    notes: dict[str, list[str]] = {}
    clashes = repeated & ~copies
    if clashes.any():
        problems.append(f"{int(clashes.sum())} spans reuse a (trace_id, span_id) with different "
                        "contents; the first is kept and their requests are marked partial")
        clashing = pd.Series(table["request_id"].to_numpy(zero_copy_only=False)[clashes])
        for request, count in clashing.groupby(clashing).size().items():
            notes[str(request)] = [f"{count} spans reuse another span's id; the first was kept"]
    kept = ~repeated & pc.is_valid(rid).to_numpy(zero_copy_only=False)
    return table.filter(pa.array(kept)), problems, notes


def _first_of(table: pa.Table, keys: list[str]) -> np.ndarray:
    """Per row: the first row with its values of `keys` (pandas' duplicated(keep='first'))."""
    numbered = table.select(keys).append_column("row", pa.array(np.arange(len(table))))
    first = numbered.group_by(keys, use_threads=False).aggregate([("row", "min")])
    out = np.zeros(len(table), dtype=bool)
    out[first["row_min"].to_numpy()] = True
    return out


def frame(table: pa.Table) -> pd.DataFrame:
    """SPAN_COLUMNS with an attribute dict per span, as analysis.otlp reads span files."""
    if table.num_rows == 0:
        return otlp.empty_spans()
    rest = [json.loads(text) if text else {} for text in
            table[spec.REST].to_pylist()]
    for key in spec.TYPED_ATTRIBUTES:
        column = table[key]
        if column.null_count == len(column):
            continue
        for attrs, value in zip(rest, column.to_pylist()):
            if value is not None:
                attrs[key] = value
    out = table.select([c for c in SPAN_COLUMNS if c != "attributes"]).to_pandas()
    out.insert(SPAN_COLUMNS.index("attributes"), "attributes", rest)
    return out.astype({"start_ns": "int64", "end_ns": "int64", "service": "str", "pid": "int64"})


def typed_frame(table: pa.Table) -> pd.DataFrame:
    """The spans with typed attribute columns and no per-span Python objects (no ids, no
    `attributes`; names, request ids and services as categoricals): what analysis reads.
    Attribute columns no span has are left out."""
    base = table.select(list(spec.ANALYSIS_COLUMNS))
    for i, field in enumerate(base.schema):
        if pa.types.is_string(field.type):
            base = base.set_column(i, field.name, base[field.name].dictionary_encode())
    out = base.to_pandas()
    for key in spec.TYPED_ATTRIBUTES:
        if key == semconv.REQUEST_ID or key not in table.column_names:
            continue  # request_id is its own column; a column not read holds nothing
        column = table[key]
        if column.null_count < len(column):
            out[key] = column.to_pandas(types_mapper=_nullable)
    return out


def _nullable(arrow_type: pa.DataType) -> Any:
    if pa.types.is_integer(arrow_type):
        return pd.Int64Dtype()
    return pd.ArrowDtype(arrow_type) if pa.types.is_list(arrow_type) else None


def values(spans: pd.DataFrame, key: str) -> list[Any]:
    """Attribute `key` of every span (None where absent), from its typed column or the dicts."""
    if key in spans.columns:
        return [_plain(v) for v in spans[key].tolist()]
    if "attributes" in spans.columns:
        return [(a or {}).get(key) for a in spans["attributes"]]
    return [None] * len(spans)  # a typed frame without the column: no span has the key


def _plain(value: Any) -> Any:
    """A typed cell as the attribute dict would hold it (None when absent, lists as lists)."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def mapped(values: pd.Series, mapping: Any) -> pd.Series:
    """`values.map(mapping)` (NaN where unmapped), once per category for a categorical."""
    if not isinstance(values.dtype, pd.CategoricalDtype):
        return values.map(mapping)
    per_category = pd.Series(values.cat.categories).map(mapping).to_numpy()
    codes = values.cat.codes.to_numpy()
    out = np.where(codes >= 0, per_category[np.maximum(codes, 0)] if len(per_category)
                   else np.nan, np.nan)
    return pd.Series(out, index=values.index)
