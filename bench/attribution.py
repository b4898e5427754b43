"""Benchmark: a day of a busy server and more, analysed from the columnar span table.

    .venv/bin/python bench/attribution.py [--requests 100000 300000 1000000]
        [--runs DIR] [--baseline CHECKOUT] [--old-up-to 300000] [--convert-old-up-to 300000]
        [--new-old-up-to 1000000] [--dask-up-to 100000] [--skip old convert plain new dask]

For each size, a synthetic run (10 spans and 10 block I/Os per request, spans written as OTLP
JSON like the tracer's; kept in --runs DIR to reuse) is measured step by step, each step in a
fresh process so its peak RSS is its own:

- old: load_run + attribute() (spans as a frame with an attribute dict each) of the code in
  --baseline (any checkout, e.g. `git archive main | tar -x -C DIR`), where it fits in memory;
- convert: OTLP JSON -> RUN/spans.parquet (once per run: `kvscope analyze` does it first);
  with --baseline, the baseline's conversion runs first (up to --convert-old-up-to requests)
  and the two tables are compared column by column;
- plain: a plain parquet read (strings as strings) of the tables and span columns the new
  load reads;
- new-old: the baseline's load_run(typed=True) + attribution in slices, rows compared;
- new: load_run(typed=True) from spans.parquet + attribution in slices (what analyze runs);
- dask: the same through `kvscope analyze --engine dask` on a local cluster of 2 workers.

It prints wall time, CPU time (of the step's process and its worker processes: on a shared
machine CPU time is what the step would take on idle cores) and peak RSS per step (the
step's process, and the largest worker's, polled: analysis.parallel runs one per core), load
/ plain (target <= 2), the new path's total at 1M requests (target <= 60 s, <= 4 GB), and whether
the old, new and Dask rows are identical (and equal the synthetic truth). The Dask step's
RSS is the client's alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

HERE = Path(__file__).resolve().parents[1]


def _make(path: Path, n: int) -> Path:
    from kvscope.testkit import synthetic

    if not (path / synthetic.EXPECTED_FILE).exists():
        synthetic.make_run(path, n_requests=n, seed=1, hit_ratio=1.0, reads_per_request=2,
                           ios_per_request=10, encoder="direct")
    return path


def _step(name: str, run: Path, rows: Path) -> dict[str, Any]:
    """One measured step, in this process (called through _spawn)."""
    out: dict[str, Any] = {}
    workers = _WorkerPeak()
    start = time.perf_counter()
    if name == "old":
        from kvscope import analysis
        loaded = analysis.load_run(run)
        out["load_s"] = time.perf_counter() - start
        frame = analysis.attribute(loaded)
        out["spans"] = len(loaded.spans)
    elif name == "convert":
        from kvscope.analysis import spantable
        from kvscope.analysis.run import clock_offset_ns
        (run / spantable.FILE).unlink(missing_ok=True)
        spantable.ensure(run, clock_offset_ns(run))
        frame = None
    elif name == "plain":
        import pyarrow.parquet as pq
        from kvscope.analysis import spantable
        from kvscope.contract import spantable as spec
        from kvscope.contract import rundir
        tables = [pd.read_parquet(run / "requests.parquet"),
                  pd.read_parquet(run / "block_io.parquet",
                                  columns=list(rundir.BLOCK_IO_ANALYSIS_COLUMNS))]
        present = pq.read_schema(run / spantable.FILE).names
        typed = [k for k in spec.TYPED_ATTRIBUTES if k in present]
        pq.read_table(run / spantable.FILE, columns=[*spec.ANALYSIS_COLUMNS, *typed]).to_pandas()
        out["tables"] = len(tables)
        frame = None
    elif name == "new":
        from kvscope import analysis
        from kvscope.analysis import slices
        loaded = analysis.load_run(run, typed=True)
        out["load_s"] = time.perf_counter() - start
        frame = slices.attribute(loaded.requests, loaded.spans, loaded.block_io,
                                 loaded.request_notes)
        out["spans"] = len(loaded.spans)
    elif name == "dask":
        from kvscope.analysis import fleet
        with tempfile.TemporaryDirectory() as tmp:
            fleet.analyze([run], tmp, engine="dask", workers=2)
            parts = sorted((Path(tmp) / "parts").glob("*.parquet"))
            frame = fleet.read_parts([str(p) for p in parts]).drop(
                columns=["run_id", "server", "device", "backend", "hour"])
    else:
        raise ValueError(name)
    out["s"] = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # worker processes, all done
    # what a shared, loaded machine cannot skew
    out["cpu_s"] = usage.ru_utime + usage.ru_stime + children.ru_utime + children.ru_stime
    out["rss_gb"] = usage.ru_maxrss / 1e6
    # worker processes (analysis.parallel): the largest one's peak; at most one per core ran
    out["worker_rss_gb"] = workers.stop()
    out["workers"] = analysis_workers()
    if frame is not None:
        frame.to_parquet(rows, index=False)
    return out


class _WorkerPeak:
    """The largest peak RSS (VmHWM) of this process's worker processes, polled while a step
    runs (RUSAGE_CHILDREN's maxrss would count the RSS a spawned child had from its parent
    before it exec'd)."""

    def __init__(self) -> None:
        import threading
        self.peak_kb = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import psutil
        me = psutil.Process()
        while not self._done.wait(0.2):
            for child in me.children(recursive=True):
                try:
                    status = Path(f"/proc/{child.pid}/status").read_text()
                except OSError:
                    continue
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak_kb = max(self.peak_kb, int(line.split()[1]))

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.peak_kb / 1e6


def analysis_workers() -> int:
    """Worker processes analysis.parallel may start here (one per core; a baseline from
    before it has none)."""
    try:
        from kvscope.analysis import parallel
    except ImportError:
        return 1
    return parallel.cores()


def _spawn(name: str, run: Path, rows: Path, pythonpath: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    done = subprocess.run([sys.executable, __file__, "--step", name, "--run", str(run),
                           "--rows", str(rows)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"step {name} on {run} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _with_workers(step: dict[str, Any]) -> float:
    """A step's peak RSS with its worker processes' (each counted at the largest one's peak,
    as if all peaked at once): what the machine must hold for it."""
    return float(step["rss_gb"] + (step["workers"] * step["worker_rss_gb"]
                                   if step.get("worker_rss_gb") else 0.0))


def _same(a: Path, b: Path) -> str:
    left, right = pd.read_parquet(a), pd.read_parquet(b)
    try:
        pd.testing.assert_frame_equal(left, right)
    except AssertionError as e:
        return f"DIFFERENT ({str(e).splitlines()[0]})"
    return "identical"


def _same_table(a: Path, b: Path) -> str:
    """Whether two span tables hold the same rows and metadata, read a column at a time (the
    row groups may differ) so that comparing 10M spans fits in memory."""
    import pyarrow.parquet as pq

    left, right = pq.ParquetFile(a), pq.ParquetFile(b)
    if left.schema_arrow.remove_metadata() != right.schema_arrow.remove_metadata():
        return "DIFFERENT (schema)"
    meta = [{k: v for k, v in (f.metadata.metadata or {}).items() if k != b"ARROW:schema"}
            for f in (left, right)]
    if meta[0] != meta[1]:
        return "DIFFERENT (metadata: problems, notes or fingerprint)"
    for name in left.schema_arrow.names:
        if not left.read([name]).column(0).equals(right.read([name]).column(0)):
            return f"DIFFERENT (column {name})"
    return "identical (every column and the metadata)"


def _truth(run: Path, rows: Path) -> str:
    from kvscope.testkit import synthetic

    truth, got = synthetic.expected(run), pd.read_parquet(rows)
    columns = [c for c in truth.columns if c.endswith("_ns")]
    equal = (got[columns].astype("int64").to_numpy() == truth[columns].to_numpy()).all()
    return "equals the synthetic truth" if equal else "DIFFERS from the synthetic truth"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[100_000])
    parser.add_argument("--runs", type=Path, help="keep the synthetic runs here (reused)")
    parser.add_argument("--baseline", type=Path, help="checkout of the code before the span "
                        "table, for the old path (git archive main | tar -x -C DIR)")
    parser.add_argument("--old-up-to", type=int, default=300_000,
                        help="largest run the old path is measured on (it needs ~35 KB/request)")
    parser.add_argument("--convert-old-up-to", type=int, default=300_000,
                        help="largest run the baseline's conversion is measured on")
    parser.add_argument("--new-old-up-to", type=int, default=1_000_000,
                        help="largest run the baseline's load and attribution are measured on")
    parser.add_argument("--dask-up-to", type=int, default=100_000)
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=("old", "convert", "plain", "new", "dask"),
                        help="steps to leave out (convert: use the run's spans.parquet as is)")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        print(json.dumps(_step(args.step, args.run, args.rows)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs or Path(tmp)
        for n in args.requests:
            _bench(n, runs, Path(tmp), args)
    return 0


def _bench(n: int, runs: Path, tmp: Path, args: argparse.Namespace) -> None:
    start = time.perf_counter()
    run = _make(runs / f"run-{n}", n)
    print(f"== {n} requests (run ready in {time.perf_counter() - start:.0f} s)", flush=True)
    steps = ["convert", "plain", "new"]
    if args.baseline and n <= args.convert_old_up_to:
        steps.insert(0, "convert-old")
    if args.baseline and n <= args.new_old_up_to:
        steps.insert(steps.index("new"), "new-old")
    if args.baseline and n <= args.old_up_to:
        steps.insert(0, "old")
    if n <= args.dask_up_to:
        steps.append("dask")
    skipped = {*args.skip, *(["convert-old"] if "convert" in args.skip else [])}
    steps = [s for s in steps if s not in skipped]
    got = {}
    for name in steps:
        path = args.baseline if name in ("old", "convert-old", "new-old") else HERE
        step = {"convert-old": "convert", "new-old": "new"}.get(name, name)
        got[name] = _spawn(step, run, tmp / f"{name}-{n}.parquet", path)
        if name == "convert-old":
            (run / "spans.parquet").rename(tmp / f"spans-old-{n}.parquet")
        r = got[name]
        load = f"  load {r['load_s']:.1f} s, attribute {r['s'] - r['load_s']:.1f} s" \
            if "load_s" in r else ""
        workers = (f" + workers' {r['worker_rss_gb']:.2f} GB each"
                   if r.get("worker_rss_gb") else "")
        print(f"  {name:11s} {r['s']:7.1f} s (CPU {r['cpu_s']:6.1f} s)  peak RSS "
              f"{r['rss_gb']:5.2f} GB{workers}{load}", flush=True)
    if "convert-old" in got and "convert" in got:
        old, new = got["convert-old"], got["convert"]
        print(f"  convert new / baseline: time {new['s'] / old['s']:.3f}, CPU "
              f"{new['cpu_s'] / old['cpu_s']:.3f}, memory {new['rss_gb'] / old['rss_gb']:.3f}; "
              f"tables {_same_table(tmp / f'spans-old-{n}.parquet', run / 'spans.parquet')}")
    if "new" not in got:
        return
    new = got["new"]
    if "plain" in got:
        print(f"  spans {new['spans']}; new load / plain parquet read = "
              f"{new['load_s'] / got['plain']['s']:.2f} (target <= 2)")
    print(f"  new path: {new['s']:.1f} s, {new['rss_gb']:.2f} GB, {_with_workers(new):.2f} GB "
          "with its workers' peaks (1M target: <= 60 s, <= 4 GB)")
    if "convert" in got:
        c = got["convert"]
        print(f"  conversion + new path: {c['s'] + new['s']:.1f} s wall, "
              f"{c['cpu_s'] + new['cpu_s']:.1f} s CPU in this process")
    if "new-old" in got:
        base = got["new-old"]
        print(f"  new path / baseline's: time {new['s'] / base['s']:.3f} (load "
              f"{new['load_s'] / base['load_s']:.3f}, attribute "
              f"{(new['s'] - new['load_s']) / (base['s'] - base['load_s']):.3f}), memory with "
              f"the workers' {_with_workers(new) / _with_workers(base):.3f}; rows "
              f"{_same(tmp / f'new-old-{n}.parquet', tmp / f'new-{n}.parquet')}")
    rows = {name: tmp / f"{name}-{n}.parquet" for name in ("old", "new", "dask") if name in got}
    print(f"  new rows {_truth(run, rows['new'])}")
    if "old" in got:
        old = got["old"]
        print(f"  old path: {old['s']:.1f} s, {old['rss_gb']:.2f} GB; new / old time "
              f"{new['s'] / old['s']:.3f}, memory {new['rss_gb'] / old['rss_gb']:.3f}; "
              f"rows {_same(rows['old'], rows['new'])}")
    if "dask" in got:
        print(f"  dask rows vs in-process rows: {_same(rows['new'], rows['dask'])}")


if __name__ == "__main__":
    raise SystemExit(main())
