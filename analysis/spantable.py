"""A run's spans as one columnar table (contract.spantable), made once and read from then on.

Parsing OTLP JSON is most of the cost of loading a run (about 120 us per span through
protobuf); the table is made once, file by file (analysis.spanstream: the rows the tracer
wrote as the file's Parquet part while it is current, else the fast reader
analysis.otlp_fast, protobuf for any document it gives back; request ids filled from the
trace, repeated span ids dropped) and cached as RUN/spans.parquet with the fingerprint of the
span files and clock it came from. Analysis reads only the columns it needs from it, typed,
with no per-span Python objects; `frame` gives the classic frame with an attribute dict per
span.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvscope.analysis import otlp, spanstream
from kvscope.contract import jsonfiles, rundir
from kvscope.contract import spantable as spec
from kvscope.contract import semconv
from kvscope.contract.semconv import SPAN_COLUMNS

FILE = "spans.parquet"
FORMAT = "2"  # bump when the table's meaning changes: older caches are then rebuilt


def span_files(run: Path) -> list[Path]:
    return sorted((Path(run) / rundir.SPANS_DIR).glob("*.json"))


def fingerprint(run: Path, offset_ns: int) -> str:
    """What the table is made from: each span file's name, size and mtime, and the clock."""
    digest = hashlib.sha256(f"{FORMAT};{offset_ns};".encode())
    for f in span_files(run):
        st = f.lstat()  # the entry itself: a link among them is refused when read
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return digest.hexdigest()[:32]


def build(files_: Iterable[Path], offset_ns: int) -> pa.Table:
    """The cleaned span table of the OTLP JSON files (problems in its metadata), in memory."""
    target = spanstream.MemoryTarget()
    spanstream.write(files_, offset_ns, target, {})
    return _read(target.source())


def load(run: Path, offset_ns: int) -> pa.Table:
    """The run's span table: RUN/spans.parquet while current, else made now (not written)."""
    path = _current(Path(run), offset_ns)
    if path is not None:
        try:
            with rundir.open_file(path, rundir.TABLE_MAX_BYTES) as file:
                return _read(file)
        except rundir.RunDirError:
            pass  # damaged below its footer: made again, as when stale
    return build(span_files(run), offset_ns)


def _read(source: Any) -> pa.Table:
    """A written span table with its metadata (kept in the Parquet footer's key-value pairs,
    which the writer adds last) as the schema's. RunDirError when it cannot be read."""
    try:
        file = pq.ParquetFile(source)
        return _filled(file.read().replace_schema_metadata(_file_meta(file)))
    except pa.ArrowException as e:
        raise rundir.RunDirError(f"{FILE}: not a readable span table ({e})") from None


def _filled(table: pa.Table) -> pa.Table:
    """`table`, read from a file; RunDirError when a column every span has a value in
    (contract.spantable FILLED) holds a null: not a table spanstream wrote."""
    for name in spec.FILLED:
        if name in table.column_names and table[name].null_count:
            raise rundir.RunDirError(f"{FILE}: column {name} is empty in "
                                     f"{table[name].null_count} rows")
    return table


def _file_meta(file: pq.ParquetFile) -> dict[bytes, bytes]:
    return {k: v for k, v in (file.metadata.metadata or {}).items() if k != b"ARROW:schema"}


@dataclass(frozen=True)
class Meta:
    """The span table's metadata (contract.spantable META_*), read and typed."""

    fingerprint: str | None
    problems: list[str]
    notes: dict[str, list[str]]


_STRINGS = {"type": "array", "items": {"type": "string"}}
_META_SCHEMAS: dict[bytes, dict[str, Any]] = {
    spec.META_FINGERPRINT: {"type": "string"}, spec.META_PROBLEMS: _STRINGS,
    spec.META_NOTES: {"type": "object", "additionalProperties": _STRINGS}}


def metadata(raw: dict[bytes, bytes]) -> Meta | None:
    """The table's metadata from its footer's key-value pairs; None when a value is not JSON
    of its type (an edited file: `_current` then makes the table again)."""
    values: dict[bytes, Any] = {}
    for key, schema in _META_SCHEMAS.items():
        if key not in raw:
            continue
        try:
            values[key] = json.loads(raw[key])
        except (ValueError, RecursionError):
            return None
        if jsonfiles.shape_problem(values[key], schema) is not None:
            return None
    return Meta(values.get(spec.META_FINGERPRINT), values.get(spec.META_PROBLEMS, []),
                values.get(spec.META_NOTES, {}))


def load_typed(run: Path, offset_ns: int, names: tuple[str, ...]
               ) -> tuple[pd.DataFrame, pd.DataFrame, dict[bytes, Any]]:
    """(typed_frame of every span, typed_frame of the spans named `names` with their
    trace_id, the table's metadata), reading from spans.parquet only the columns that hold
    anything (a typed column no span has is never read)."""
    path = _current(Path(run), offset_ns)
    if path is not None:
        try:
            return _typed_from_file(path, names)
        except rundir.RunDirError:
            pass  # damaged below its footer: made again, as when stale
    table = build(span_files(run), offset_ns)
    columns = [*spec.ANALYSIS_COLUMNS,
               *(k for k in spec.TYPED_ATTRIBUTES if table[k].null_count < len(table))]
    some = table.filter(_named(names))
    return _typed(table.select(columns), some.select([*columns, "trace_id"]),
                  dict(table.schema.metadata or {}))


def _named(names: tuple[str, ...]) -> pc.Expression:
    return pc.field("name").isin(list(names))


def _typed(every: pa.Table, some: pa.Table, meta: dict[bytes, Any]
           ) -> tuple[pd.DataFrame, pd.DataFrame, dict[bytes, Any]]:
    chosen = typed_frame(some).assign(trace_id=some["trace_id"].to_pandas())
    return typed_frame(every), chosen, meta


def _typed_from_file(path: Path, names: tuple[str, ...]
                     ) -> tuple[pd.DataFrame, pd.DataFrame, dict[bytes, Any]]:
    """load_typed of a current spans.parquet: strings read as dictionaries (a code per span,
    never the span's string). RunDirError when it cannot be read."""
    with rundir.open_file(path, rundir.TABLE_MAX_BYTES) as file:
        try:
            parquet = pq.ParquetFile(file)
            columns = [*spec.ANALYSIS_COLUMNS, *_holding(parquet)]
            every = _filled(pq.read_table(file, columns=columns, read_dictionary=[
                c for c in columns if pa.types.is_string(spec.SCHEMA.field(c).type)]))
            some = _filled(pq.read_table(file, columns=[*columns, "trace_id"],
                                         filters=_named(names)))
        except pa.ArrowException as e:
            raise rundir.RunDirError(f"{path}: not a readable span table ({e})") from None
        return _typed(every, some, _file_meta(parquet))


def _holding(file: pq.ParquetFile) -> list[str]:
    """The typed attribute columns some span has a value in (from the file's statistics)."""
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
        spanstream.write(span_files(run), offset_ns, spanstream.FileTarget(path),
                         {spec.META_FINGERPRINT: fingerprint(run, offset_ns)})
    return path


def _current(run: Path, offset_ns: int) -> Path | None:
    """RUN/spans.parquet when it was made from the run's span files as they are now; None
    when it is missing or stale, and also when it is not a regular file, not parquet, not of
    the table's schema or its metadata is not of its types: the table is a cache of the span
    files, so a damaged or edited one is made again from them, as a stale one is, rather than
    refused (the span files are the run's record, and they are read as untrusted anyway)."""
    path = run / FILE
    try:
        with rundir.open_file(path, rundir.TABLE_MAX_BYTES) as file:
            parquet = pq.ParquetFile(file)
            schema, meta_ = parquet.schema_arrow, metadata(_file_meta(parquet))
    except (OSError, ValueError, pa.ArrowException):  # RunDirError is a ValueError
        return None
    if meta_ is None or not schema.remove_metadata().equals(spec.SCHEMA):
        return None
    return path if meta_.fingerprint == fingerprint(run, offset_ns) else None


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
    `attributes`): what analysis reads. Strings (names, request ids, services, string
    attributes) are categoricals, the other attributes Arrow-backed (nullable, lists as Arrow
    lists). Attribute columns no span has are left out."""
    keys = [k for k in spec.TYPED_ATTRIBUTES if k != semconv.REQUEST_ID  # its own column
            and k in table.column_names and table[k].null_count < len(table)]
    chosen = table.select([*spec.ANALYSIS_COLUMNS, *keys])
    for i, field in enumerate(chosen.schema):
        if pa.types.is_string(field.type):
            chosen = chosen.set_column(i, field.name, chosen[field.name].dictionary_encode())
    base = chosen.select(list(spec.ANALYSIS_COLUMNS)).to_pandas()
    attributes = chosen.select(keys).to_pandas(types_mapper=_arrow_backed)
    return pd.concat([base, attributes], axis=1)


def _arrow_backed(arrow_type: pa.DataType) -> pd.ArrowDtype | None:
    """pandas' type of a typed attribute column: a categorical (None) for strings, else the
    Arrow type itself (nullable integers and floats, lists)."""
    return None if pa.types.is_dictionary(arrow_type) else pd.ArrowDtype(arrow_type)


def arrow(spans: pd.DataFrame, key: str) -> pa.Array:
    """Attribute `key` of every span as an Arrow array of its declared type (null where
    absent), for Arrow's compute functions."""
    if key in spans.columns:
        return pa.array(spans[key])
    return pa.array(values(spans, key), spec.TYPED_ATTRIBUTES[key])


def values(spans: pd.DataFrame, key: str) -> list[Any]:
    """Attribute `key` of every span (None where absent), from its typed column or the dicts."""
    if key in spans.columns:
        return list(arrow(spans, key).to_pylist())
    if "attributes" in spans.columns:
        return [(a or {}).get(key) for a in spans["attributes"]]
    return [None] * len(spans)  # a typed frame without the column: no span has the key


def mapped(values: pd.Series, mapping: Any) -> pd.Series:
    """`values.map(mapping)` (NaN where unmapped), once per category for a categorical."""
    if not isinstance(values.dtype, pd.CategoricalDtype):
        return values.map(mapping)
    per_category = pd.Series(values.cat.categories).map(mapping).to_numpy()
    codes = values.cat.codes.to_numpy()
    out = np.where(codes >= 0, per_category[np.maximum(codes, 0)] if len(per_category)
                   else np.nan, np.nan)
    return pd.Series(out, index=values.index)
