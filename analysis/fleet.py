"""Many runs at once (a fleet's servers, a week of recordings), in this process or on Dask.

The unit of work is one run, one server's recording: its task makes the run's span table if
it is not current, attributes the run slice by slice (analysis.slices, so a worker holds one
slice and the run's compact columns) and writes the rows, labelled with where each request
ran (contract.fleet.LABELS), to OUT/parts/. The same task runs here (engine "local") or on the
workers of a Dask cluster (engine "dask": the scheduler at an address, or a local cluster),
which need kvscope installed and the run directories at the same paths (shared storage).
The fleet summary is made from the parts, per server, device, backend and hour.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from kvscope.analysis import outputs
from kvscope.analysis.attribution import COMPONENTS
from kvscope.analysis.run import Run
from kvscope.contract import fleet, files

ENGINES = ("local", "dask")


def analyze(sources: Sequence[str | Path], out: str | Path, *, engine: str = "local",
            scheduler: str | None = None, workers: int = 2) -> pd.DataFrame:
    """Attribute every run of `sources` (run directories, or their spans.parquet), write the
    parts to OUT/parts/ and the summary to OUT/fleet_summary.parquet; return the summary."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    out = files.private_dir(out)
    files.private_dir(out / fleet.PARTS_DIR)
    jobs = [(str(run_dir(s)), str(out), i) for i, s in enumerate(sources)]
    if engine == "local":
        parts = [run_part(*job) for job in jobs]
    else:
        parts = _on_dask(jobs, scheduler, workers)
    summary = summarize(read_parts(parts))
    with files.atomic_writer(out / fleet.SUMMARY_FILE) as f:
        summary.to_parquet(f, index=False)
    return summary


def run_dir(source: str | Path) -> Path:
    """The run directory a source names (a run directory, or the span table inside one)."""
    path = Path(source)
    if path.name == outputs.SPANS_FILE:
        path = path.parent
    if not path.is_dir():
        raise FileNotFoundError(f"{source} is not a run directory or its {outputs.SPANS_FILE}")
    return path


def run_part(run: str, out: str, index: int) -> str:
    """One run's labelled attribution rows, written to OUT/parts/; the part's path."""
    loaded, rows = outputs.attribute_run(run)
    labelled = pd.concat([labels(loaded), rows], axis=1)
    path = Path(out) / fleet.PARTS_DIR / f"{index:05d}-{Path(run).name}.parquet"
    with files.atomic_writer(path) as f:
        labelled.to_parquet(f, index=False)
    return str(path)


def read_parts(parts: Sequence[str]) -> pd.DataFrame:
    """The rows of every part, in the order of the runs given."""
    return pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True)


def labels(run: Run) -> pd.DataFrame:
    """Per request of `run`: LABELS (run, server, device, backend, UTC hour of arrival)."""
    manifest = run.manifest
    machine = manifest.get("machine") or {}
    backend = manifest.get("backend") or {}
    offset = int((manifest.get("clock") or {}).get("offset_ns", 0))
    arrival = pd.to_datetime(run.requests["arrival_ns"].to_numpy(np.int64) + offset, unit="ns",
                             utc=True)
    n = len(run.requests)
    values: dict[str, Any] = {
        "run_id": str(manifest.get("run_id") or run.path.name),
        "server": str(machine.get("hostname", "")),
        "device": str(machine.get("disk_device", "")),
        "backend": str(backend.get("profile")
                       or Path(str(backend.get("lmcache_config_file", ""))).name),
        "hour": arrival.floor("h").strftime("%Y-%m-%dT%H:00Z"),
    }
    return pd.DataFrame({k: np.broadcast_to(values[k], n) if isinstance(values[k], str)
                         else np.asarray(values[k]) for k in fleet.LABELS})


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """Per server, device, backend and hour: runs, complete requests, TTFT p50/p90/p99 (ms)
    and each component's share of TTFT."""
    complete = rows[~rows["partial"].astype(bool) & rows["ttft_ns"].notna()]
    out = []
    for by in fleet.GROUPS:
        for value, group in complete.groupby(by, sort=True):
            ttft = group["ttft_ns"].astype("float64") / 1e6
            total = float(group["ttft_ns"].sum())
            out.append({"by": by, "value": str(value), "runs": group["run_id"].nunique(),
                        "requests": len(group),
                        **{f"ttft_p{q}_ms": float(ttft.quantile(q / 100)) for q in (50, 90, 99)},
                        **{f"{c}_share": float(group[f"{c}_ns"].sum()) / total if total else None
                           for c in COMPONENTS}})
    columns = [*fleet.SUMMARY_COLUMNS, *(f"{c}_share" for c in COMPONENTS)]
    return pd.DataFrame(out, columns=columns)


def _on_dask(jobs: list[tuple[str, str, int]], scheduler: str | None, workers: int) -> list[str]:
    """run_part of every job on a Dask cluster: the scheduler's, or a local one of `workers`
    single-threaded worker processes (attribution is NumPy-bound and holds the GIL)."""
    from distributed import Client, LocalCluster

    def run(client: Client) -> list[str]:
        futures = client.map(run_part, *zip(*jobs), pure=False)
        return list(client.gather(futures))

    if scheduler:
        with Client(scheduler) as client:
            return run(client)
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        return run(client)
