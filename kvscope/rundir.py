"""The run directory, schema v2: the one contract between producers and readers.

Producers (workload driver, tracer, probes) write it; analysis and dashboards only read it.
docs/run-directory.md explains every field; TABLES below is the machine-checked part of it.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pandas as pd

SCHEMA_VERSION = 2
# v2 adds to v1 only (tables io_histograms / io_totals, manifest sections server / recording,
# runs whose requests come from server spans), so a v1 run reads as it always did.
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
SPANS_DIR = "spans"
SERVER_LOG = "server.log"
REQUIRED_MANIFEST_KEYS = (
    "schema_version", "run_id", "created_at", "command", "model", "backend", "workload",
    "machine", "versions", "clock", "phases",
)


@dataclass(frozen=True)
class TableSpec:
    """A parquet table of the run: file name, required columns (pandas dtype kind) and producer."""

    file: str
    columns: dict[str, str]
    producer: str


# Column kinds: "i" integer, "f" float, "s" string, "b" bool. All *_ns columns are
# CLOCK_MONOTONIC nanoseconds of the host; manifest["clock"]["offset_ns"] maps them to epoch.
TABLES: dict[str, TableSpec] = {
    "requests": TableSpec(
        "requests.parquet",
        {
            "request_id": "s", "phase": "s", "concurrency": "i", "prompt_index": "i",
            "trace_id": "s", "prompt_tokens": "i", "cached_tokens": "i", "output_tokens": "i",
            "arrival_ns": "i", "first_token_ns": "i", "finish_ns": "i",
            "ttft_s": "f", "e2e_s": "f", "status": "s", "error": "s",
        },
        "workload driver (kvscope run)",
    ),
    "block_io": TableSpec(
        "block_io.parquet",
        {
            "phase": "s", "device": "s", "dev": "s", "sector": "i", "bytes": "i", "op": "s",
            "pid": "i", "tid": "i", "comm": "s", "start_ns": "i", "issue_ns": "i",
            "complete_ns": "i", "error": "i",
        },
        "probes (block probe)",
    ),
    "queue_depth": TableSpec(
        "queue_depth.parquet",
        {"phase": "s", "ts_ns": "i", "device": "s", "hw_queue": "i", "inflight": "i", "source": "s"},
        "probes (block and NVMe probes, or the sysfs fallback sampler)",
    ),
    "nvme_io": TableSpec(
        "nvme_io.parquet",
        {
            "phase": "s", "ctrl_id": "i", "transport": "s", "disk": "s", "qid": "i", "cid": "i",
            "opcode": "i", "nsid": "i", "bytes": "i", "setup_ns": "i", "complete_ns": "i",
            "status": "i",
        },
        "probes (NVMe probe)",
    ),
    "io_histograms": TableSpec(
        "io_histograms.parquet",
        {
            "phase": "s", "device": "s", "pid": "i", "op": "s", "kind": "s", "slot": "i",
            "lo_us": "i", "hi_us": "i", "count": "i",
        },
        "probes (aggregate block probe)",
    ),
    "io_totals": TableSpec(
        "io_totals.parquet",
        {
            "phase": "s", "device": "s", "pid": "i", "op": "s", "ios": "i", "bytes": "i",
            "queue_ns": "i", "service_ns": "i", "no_start": "i", "no_issue": "i",
            "window_ns": "i",
        },
        "probes (aggregate block probe)",
    ),
}


class RunDirError(ValueError):
    """A run directory that cannot be read by this kvscope; the message says what and where."""


_DTYPES = {"i": "int64", "f": "float64", "s": "str", "b": "bool"}


def empty_table(name: str) -> pd.DataFrame:
    """Table `name` with its schema columns and no rows."""
    columns = TABLES[name].columns
    return pd.DataFrame({c: pd.Series(dtype=_DTYPES[k]) for c, k in columns.items()})


def table_path(run: Path, name: str) -> Path:
    return Path(run) / TABLES[name].file


@contextmanager
def _locked(run: Path) -> Iterator[None]:
    """Serialise read-modify-write of shared files across the producer processes."""
    with open(Path(run) / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _atomic_write(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def create(run: Path, manifest: dict[str, Any]) -> Path:
    """Make a new run directory with its manifest; refuses to overwrite an existing run."""
    run = Path(run)
    if (run / MANIFEST).exists():
        raise RunDirError(f"{run} already holds a run; pick a new --out directory")
    run.mkdir(parents=True, exist_ok=True)
    (run / SPANS_DIR).mkdir(exist_ok=True)
    body = {"schema_version": SCHEMA_VERSION, **manifest}
    _atomic_write(run / MANIFEST, lambda f: f.write(json.dumps(body, indent=2).encode()))
    return run


def read_manifest(run: Path) -> dict[str, Any]:
    path = Path(run) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunDirError(f"{run} is not a kvscope run directory: {MANIFEST} is missing") from None
    except json.JSONDecodeError as e:
        raise RunDirError(f"{path} is not valid JSON ({e}); the run was cut short") from None
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
        _atomic_write(run / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))


def append_table(run: Path, name: str, frame: pd.DataFrame) -> None:
    """Add rows to a table, creating it on first use (phases append one after another)."""
    missing = _missing_columns(name, frame)
    if missing:
        raise RunDirError(f"rows for {name} lack columns {missing}")
    path = table_path(run, name)
    with _locked(Path(run)):
        if path.exists():
            frame = pd.concat([pd.read_parquet(path), frame], ignore_index=True)
        _atomic_write(path, lambda f: frame.to_parquet(f, index=False))


def read_table(run: Path, name: str) -> pd.DataFrame | None:
    """The table, or None when this run has none (a producer was off)."""
    path = table_path(run, name)
    if not path.exists():
        return None
    return pd.read_parquet(path)


def _missing_columns(name: str, frame: pd.DataFrame) -> list[str]:
    return [c for c in TABLES[name].columns if c not in frame.columns]


def _wrong_kinds(name: str, frame: pd.DataFrame) -> list[str]:
    problems = []
    for column, kind in TABLES[name].columns.items():
        if column not in frame.columns:
            continue
        dtype = frame[column].dtype
        actual = "s" if (dtype == object or pd.api.types.is_string_dtype(dtype)) else dtype.kind
        if actual == "u":
            actual = "i"
        if actual != kind and not (kind == "f" and actual == "i"):
            problems.append(f"{TABLES[name].file}: column {column} is {dtype}, expected kind {kind}")
    return problems


def validate(run: Path) -> list[str]:
    """Every way this directory breaks the schema, as readable lines (empty when it is valid)."""
    run = Path(run)
    try:
        manifest = read_manifest(run)
    except RunDirError as e:
        return [str(e)]
    problems = [f"{MANIFEST}: missing key {k}" for k in REQUIRED_MANIFEST_KEYS if k not in manifest]
    if not table_path(run, "requests").exists():
        problems.append(f"{TABLES['requests'].file} is missing")
    for name in TABLES:
        frame = read_table(run, name)
        if frame is None:
            continue
        problems += [f"{TABLES[name].file}: missing column {c}" for c in _missing_columns(name, frame)]
        problems += _wrong_kinds(name, frame)
    return problems
