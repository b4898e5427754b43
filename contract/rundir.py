"""The run directory, schema v4: its layout, its tables' schemas, and how to read and write it.

Producers (workload driver, tracer, probes) write it; analysis and dashboards only read it.
docs/run-directory.md explains every field; TABLES below is the machine-checked part of it:
each table's required columns as a pyarrow schema, checked against a parquet file's own schema
(its footer) without reading the data.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvscope.contract import files, jsonfiles
from kvscope.contract.clock import MAX_OFFSET_NS

SCHEMA_VERSION = 4
# v2 adds to v1 only (tables io_histograms / io_totals, manifest sections server / recording,
# runs whose requests come from server spans), so a v1 run reads as it always did; v3 moves the
# disk backend's counters from manifest.tracer to manifest.disk_backend (readers try both);
# v4 adds the chunk ledger (the kv.ledger span, the chunk_ledger table analysis writes from
# it): an older run has no ledger spans and reads with an empty ledger.
READABLE_VERSIONS = (1, 2, 3, 4)
MANIFEST = "manifest.json"
SPANS_DIR = "spans"
SERVER_LOG = "server.log"
BACKEND_STATS_DIR = "backend"  # RUN/backend/<pid>.json: each server process's disk counters
# What a reader takes from a run at most (docs/security.md): a run may come from another host
# or another user, so each file is read only if it is a regular file within its cap.
MANIFEST_MAX_BYTES = 16 << 20  # a manifest is a few KB; its phases' vLLM configs a few more
SPAN_FILE_MAX_BYTES = 256 << 20  # one export batch is ~1 MB; an OTLP request at most ~20 MB
TABLE_MAX_BYTES = 16 << 30  # a parquet table; block_io of a day's run (10M I/Os) is ~300 MB
REQUIRED_MANIFEST_KEYS = (
    "schema_version", "run_id", "created_at", "command", "model", "backend", "workload",
    "machine", "versions", "clock", "phases",
)
_OBJECT, _INTEGER = {"type": "object"}, {"type": "integer"}
# The types readers rely on wherever a manifest has these fields (a run may come from another
# host or another user): a field of another type makes the run unreadable, not a traceback.
MANIFEST_SCHEMA = {
    "type": "object",
    "properties": {
        "schema_version": _INTEGER,
        "clock": {"type": "object", "properties": {
            "offset_ns": {"type": "integer", "minimum": -MAX_OFFSET_NS, "maximum": MAX_OFFSET_NS},
            "uncertainty_ns": {"type": "integer", "minimum": 0}}},
        "phases": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "kind": {"type": "string"}, "concurrency": _INTEGER,
            "started_ns": _INTEGER, "ended_ns": _INTEGER, "vllm": _OBJECT}}},
        **dict.fromkeys(("model", "backend", "workload", "machine", "versions", "server",
                         "tracer", "disk_backend", "recording", "probes", "study"), _OBJECT),
        # the block device the chunks were read from (runs before issue 31 have none)
        "device": {"type": "object", "required": ["kind", "name"], "properties": {
            "kind": {"enum": ["disk", "twin"]}, "name": {"type": "string"},
            "profile": _OBJECT, "stack_latency_us": {"type": "number"}}},
    },
}


@dataclass(frozen=True)
class TableSpec:
    """A parquet table of the run: file name, required columns and which producer writes it."""

    file: str
    schema: pa.Schema
    producer: str
    # string columns of a few repeated values (phase, device, op...): read as categoricals, a
    # code per row instead of a string (block_io holds one row per I/O: 10M at a day's run)
    labels: tuple[str, ...] = ()
    # columns every row has a value in (readers compute with them; a null is refused)
    filled: tuple[str, ...] = ()

    @property
    def columns(self) -> list[str]:
        return self.schema.names


def _schema(**columns: pa.DataType) -> pa.Schema:
    return pa.schema(list(columns.items()))


I, F, S = pa.int64(), pa.float64(), pa.string()
# io_totals' per-request counters, in the order the aggregate probe's kernel record holds them
IO_TOTALS_COUNTERS = ("ios", "bytes", "queue_ns", "service_ns", "no_start", "no_issue")
# All *_ns columns are CLOCK_MONOTONIC nanoseconds of the host; manifest["clock"]["offset_ns"]
# maps them to epoch. Extra columns (block_io.insert_ns, io_totals' mean depths) are allowed.
_REQUESTS = _schema(
    request_id=S, phase=S, concurrency=I, prompt_index=I, trace_id=S, prompt_tokens=I,
    cached_tokens=I, output_tokens=I, arrival_ns=I, first_token_ns=I, finish_ns=I, ttft_s=F,
    e2e_s=F, status=S, error=S)
TABLES: dict[str, TableSpec] = {
    "requests": TableSpec("requests.parquet", _REQUESTS, "workload driver (kvscope run)",
                          # the driver writes -1 / "" for what it does not know; a failed
                          # request's seconds are NaN, which parquet keeps as null
                          filled=tuple(n for n in _REQUESTS.names if not n.endswith("_s"))),
    "block_io": TableSpec("block_io.parquet", _schema(
        phase=S, device=S, dev=S, sector=I, bytes=I, op=S, pid=I, tid=I, comm=S, start_ns=I,
        issue_ns=I, complete_ns=I, error=I), "probes (block probe)",
        labels=("phase", "device", "dev", "op", "comm")),
    "queue_depth": TableSpec("queue_depth.parquet", _schema(
        phase=S, ts_ns=I, device=S, hw_queue=I, inflight=I, source=S),
        "probes (block and NVMe probes, or the sysfs fallback sampler)",
        labels=("phase", "device", "source")),
    "nvme_io": TableSpec("nvme_io.parquet", _schema(
        phase=S, ctrl_id=I, transport=S, disk=S, qid=I, cid=I, opcode=I, nsid=I, bytes=I,
        setup_ns=I, complete_ns=I, status=I), "probes (NVMe probe)"),
    "io_histograms": TableSpec("io_histograms.parquet", _schema(
        phase=S, device=S, pid=I, op=S, kind=S, slot=I, lo_us=I, hi_us=I, count=I),
        "probes (aggregate block probe)"),
    "io_totals": TableSpec("io_totals.parquet", _schema(
        phase=S, device=S, pid=I, op=S, **dict.fromkeys(IO_TOTALS_COUNTERS, I), window_ns=I),
        "probes (aggregate block probe)"),
}

# What analysis reads of block_io (the join to requests, bandwidth, Little's law, the read
# path): a typed load (analysis.load_run(typed=True)) reads only these; dev, pid, comm and
# error are there for people reading the table.
BLOCK_IO_ANALYSIS_COLUMNS = ("phase", "device", "op", "sector", "bytes", "tid", "start_ns",
                             "issue_ns", "complete_ns")


# The chunk ledger: one row per chunk a request looked up, written by analysis from the
# worker's kv.ledger spans (an output, like attribution.parquet: not checked by validate()).
CHUNK_LEDGER = TableSpec("chunk_ledger.parquet", _schema(
    request_id=S, vllm_request_id=S, lookup_ns=I, chunk_index=I, start_token=I, end_token=I,
    tokens=I, chunk_hash=S, tier=S, reason=S, detail=S, fact_ns=I, stored_ns=I,
    diverged_at=I), "analysis (from the tracer's kv.ledger spans)")


class RunDirError(ValueError):
    """A run directory that cannot be read by this kvscope; the message says what and where."""


def empty_table(name: str) -> pd.DataFrame:
    """Table `name` with its schema columns and no rows."""
    return TABLES[name].schema.empty_table().to_pandas()


def table_path(run: Path, name: str) -> Path:
    return Path(run) / TABLES[name].file


@contextmanager
def _locked(run: Path) -> Iterator[None]:
    """Serialise read-modify-write of shared files across the producer processes."""
    with ExitStack() as held:
        try:
            held.enter_context(files.locked(Path(run) / ".lock"))
        except files.UnsafePath as e:
            raise RunDirError(str(e)) from None
        yield


def create(run: Path, manifest: dict[str, Any]) -> Path:
    """Make a new run directory (0700, with its spans/) holding its manifest. `run` must not
    exist, or be an empty directory of this user (see contract.files: the invoking user under
    sudo); a run, a file, a link or another user's directory there is refused in one line."""
    run = Path(run)
    if (run / MANIFEST).exists():
        raise RunDirError(f"{run} already holds a run; pick a new --out directory")
    try:
        if os.path.lexists(run):
            files.check_private_dir(run)
            if any(os.scandir(run)):
                raise RunDirError(f"{run} is not empty; pick a new --out directory (a run is "
                                  "made in a new or empty directory)")
        else:
            files.private_dir(run)
        os.mkdir(run / SPANS_DIR, files.PRIVATE_DIR_MODE)
    except files.UnsafePath as e:
        raise RunDirError(f"--out {e}") from None
    except OSError as e:
        raise RunDirError(f"--out {run}: {e.strerror} ({e.filename}); name a directory you can "
                          "write") from None
    body = {"schema_version": SCHEMA_VERSION, **manifest}
    files.atomic_write(run / MANIFEST, json.dumps(body, indent=2))
    return run


@contextmanager
def open_file(path: Path, max_bytes: int) -> Iterator[IO[bytes]]:
    """A file of a run open for reading: how every reader (analysis, the dashboard, exports)
    reads a run's files, inputs and outputs alike. A run may have been copied from another
    host or written by another user, so its files' owners are not checked (their contents are,
    by type) but each must be a regular file within `max_bytes` (contract.files.open_trusted:
    no link to /dev/zero, no FIFO to wait on, no device). RunDirError, in one line naming the
    file, for that or for any read error in the block; FileNotFoundError passes through."""
    with _refused_in_one_line(path):
        with files.open_trusted(path, max_bytes, files.ANY_OWNER) as file:
            yield file


def read_file(path: Path, max_bytes: int) -> bytes:
    """The contents of a run's file, read as `open_file` says."""
    with _refused_in_one_line(path):
        return files.read_bytes(path, max_bytes, files.ANY_OWNER)


@contextmanager
def _refused_in_one_line(path: Path) -> Iterator[None]:
    try:
        yield
    except files.UnsafePath as e:
        raise RunDirError(str(e)) from None
    except FileNotFoundError:
        raise
    except OSError as e:
        raise RunDirError(f"{path}: {one_line(e.strerror or str(e))}") from None


def one_line(text: str) -> str:
    """`text` (an error another library wrote) as one line."""
    return " ".join(text.split())


def read_manifest(run: Path) -> dict[str, Any]:
    path = Path(run) / MANIFEST
    try:
        manifest = json.loads(read_file(path, MANIFEST_MAX_BYTES))
    except FileNotFoundError:
        raise RunDirError(f"{run} is not a kvscope run directory: {MANIFEST} is missing") from None
    except RecursionError:
        raise RunDirError(f"{path} is nested too deeply to be a manifest") from None
    except RunDirError:
        raise
    except ValueError as e:  # not JSON, or not UTF-8
        raise RunDirError(f"{path} is not valid JSON ({one_line(str(e))}); the run was cut "
                          "short") from None
    if not isinstance(manifest, dict):
        raise RunDirError(f"{path} holds a JSON {type(manifest).__name__}, not an object; it is "
                          "not a kvscope manifest")
    version = manifest.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise RunDirError(
            f"{path} has schema_version {version!r}; this kvscope reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    return manifest


def update_manifest(run: Path, section: str, value: Any) -> None:
    """Set one top-level section of the manifest (producers own their own sections)."""
    run = Path(run)
    with _locked(run):
        manifest = read_manifest(run)
        manifest[section] = value
        files.atomic_write(run / MANIFEST, json.dumps(manifest, indent=2))


def append_table(run: Path, name: str, frame: pd.DataFrame) -> None:
    """Add rows to a table, creating it on first use (phases append one after another).

    A parquet file cannot grow in place (its footer indexes the row groups), so the rows so far
    are read back and rewritten with the new ones; a run has a handful of phases."""
    missing = [c for c in TABLES[name].columns if c not in frame.columns]
    if missing:
        raise RunDirError(f"rows for {name} lack columns {missing}")
    path = table_path(run, name)
    with _locked(Path(run)):
        if path.exists():
            with open_file(path, TABLE_MAX_BYTES) as file:
                frame = pd.concat([pd.read_parquet(file), frame], ignore_index=True)
        with files.atomic_writer(path) as f:
            frame.to_parquet(f, index=False)


def read_table(run: Path, name: str, columns: Sequence[str] | None = None
               ) -> pd.DataFrame | None:
    """The table, or None when this run has none (a producer was off). `columns`: only those
    of them the file has. Its label columns (TableSpec.labels) come as categoricals whose
    categories are in sorted order, so sorting or grouping by them orders rows as their
    strings would. RunDirError when the file is not one parquet can read."""
    path = table_path(run, name)
    if not path.exists():
        return None
    with open_file(path, TABLE_MAX_BYTES) as file:
        try:
            frame = _read_parquet(file, TABLES[name], columns)
        except pa.ArrowException as e:
            raise _not_parquet(path, e) from None
    _check_filled(path, TABLES[name], frame)
    for c in frame.columns:
        if isinstance(frame[c].dtype, pd.CategoricalDtype):
            frame[c] = frame[c].cat.reorder_categories(frame[c].cat.categories.sort_values())
    return frame


def _check_filled(path: Path, spec: TableSpec, frame: pd.DataFrame) -> None:
    """RunDirError naming the first column of `spec.filled` that has a null in `frame`."""
    for column in (c for c in spec.filled if c in frame.columns):
        empty = frame[column].isna().to_numpy()
        if empty.any():
            raise RunDirError(f"{path}: column {column} is empty in {int(empty.sum())} rows "
                              f"(the first is row {int(empty.argmax())}); every row has one")


def _read_parquet(file: IO[bytes], spec: TableSpec, columns: Sequence[str] | None
                  ) -> pd.DataFrame:
    schema = pq.read_schema(file)
    read = schema.names if columns is None else [c for c in columns if c in schema.names]
    labels = [c for c in spec.labels if c in read
              and (pa.types.is_string(schema.field(c).type)
                   or pa.types.is_large_string(schema.field(c).type))]
    return pd.read_parquet(file, columns=None if columns is None else read,
                           read_dictionary=labels)


def schema_problems(name: str, schema: pa.Schema) -> list[str]:
    """How a file's schema breaks table `name`'s (`spec_problems`)."""
    return spec_problems(TABLES[name], schema)


def spec_problems(spec: TableSpec, schema: pa.Schema) -> list[str]:
    """How a file's schema breaks `spec`'s: missing columns, columns of the wrong type (any
    integer width is an integer, an integer column may stand for a float one, an all-null
    column of an empty table fits any type)."""
    problems = []
    for want in spec.schema:
        if want.name not in schema.names:
            problems.append(f"{spec.file}: missing column {want.name}")
        elif not _fits(schema.field(want.name).type, want.type):
            problems.append(f"{spec.file}: column {want.name} is {schema.field(want.name).type}, "
                            f"expected {want.type}")
    return problems


def _fits(got: pa.DataType, want: pa.DataType) -> bool:
    if pa.types.is_null(got) or got == want:
        return True
    if pa.types.is_integer(want):
        return pa.types.is_integer(got)
    if pa.types.is_floating(want):
        return pa.types.is_floating(got) or pa.types.is_integer(got)
    if pa.types.is_string(want):
        return pa.types.is_string(got) or pa.types.is_large_string(got)
    return False


def validate(run: Path) -> list[str]:
    """Every way this directory breaks the schema, as readable lines (empty when it is valid):
    first what makes it unreadable (`unreadable`), then what it lacks."""
    run = Path(run)
    problems = unreadable(run)
    try:
        manifest = read_manifest(run)
    except RunDirError as e:
        return problems if (run / MANIFEST).exists() else [str(e), *problems]
    problems += [f"{MANIFEST}: missing key {k}" for k in REQUIRED_MANIFEST_KEYS
                 if k not in manifest]
    if not table_path(run, "requests").exists():
        problems.append(f"{TABLES['requests'].file} is missing")
    return problems


def unreadable(run: Path) -> list[str]:
    """What no reader may use, one line each naming the file and the field: a manifest that
    cannot be read or has a field of the wrong type or range (MANIFEST_SCHEMA), a table that
    is not parquet or has a column of the wrong type. Tables are checked by their parquet
    schemas alone: no data is read. A missing column or table is not here (readers do
    without it)."""
    run = Path(run)
    problems = []
    if (run / MANIFEST).exists():
        try:
            manifest = read_manifest(run)
        except RunDirError as e:
            problems.append(str(e))
        else:
            problems += [f"{MANIFEST}: {line}"
                         for line in jsonfiles.shape_problems(manifest, MANIFEST_SCHEMA)]
    for name, spec in TABLES.items():
        path = table_path(run, name)
        if not path.exists():
            continue
        try:
            schema = read_schema(path)
        except RunDirError as e:
            problems.append(str(e))
            continue
        problems += [p for p in schema_problems(name, schema) if "missing column" not in p]
    return problems


def read_schema(path: Path) -> pa.Schema:
    """The schema in a parquet file's footer (no data is read); RunDirError naming the file
    when it is not parquet."""
    with open_file(path, TABLE_MAX_BYTES) as file:
        try:
            return pq.read_schema(file)
        except pa.ArrowException as e:
            raise _not_parquet(path, e) from None


def _not_parquet(path: Path, error: Exception) -> RunDirError:
    return RunDirError(f"{path}: not a readable parquet file ({one_line(str(error))})")


def check_readable(run: Path) -> None:
    """RunDirError naming the first of `unreadable(run)` (and how many more there are)."""
    problems = unreadable(run)
    if problems:
        first = problems[0] if problems[0].startswith(str(run)) else f"{Path(run) / problems[0]}"
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise RunDirError(f"{first}{more}; the run cannot be read")
