"""Benchmark: attribution time vs the time to load the same tables (target ratio <= 3).

    .venv/bin/python bench/attribution.py [--requests 100000]

Builds a synthetic run (10 spans and 10 block I/Os per request), then times, side by side in
one process: load_run (parquet tables + OTLP JSON spans through opentelemetry-proto), a plain
parquet read of the same tables with the spans already tabular, and attribute(). It prints
attribute / load_run and attribute / parquet-only; the second is the strict figure, since
OTLP JSON parsing dominates load_run. The synthetic lanes are separate worker processes, so no
request waits on another's work; attribute() is timed a second time with every span moved into
one process, where the concurrent lanes do wait on each other (the batch-aware path at work).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pandas as pd

from kvscope import analysis
from kvscope.testkit import synthetic


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def _parquet_only(run_path: Path, spans_file: Path) -> tuple:
    tables = [pd.read_parquet(run_path / f) for f in
              ("requests.parquet", "block_io.parquet", "queue_depth.parquet")]
    spans = pd.read_parquet(spans_file)
    spans["attributes"] = [json.loads(a) for a in spans["attributes"]]
    return tables, spans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path, made = _timed(lambda: synthetic.make_run(
            Path(tmp) / "run", n_requests=args.requests, seed=1, hit_ratio=1.0,
            reads_per_request=2, ios_per_request=10))
        run, load = _timed(analysis.load_run, path)
        spans_file = Path(tmp) / "spans.parquet"
        run.spans.assign(attributes=[json.dumps(a) for a in run.spans["attributes"]]).to_parquet(spans_file)
        _, parquet = _timed(_parquet_only, path, spans_file)
        frame, attribute = _timed(analysis.attribute, run)
        run.spans["pid"] = run.spans["pid"].min()
        shared, attribute_shared = _timed(analysis.attribute, run)
    joined = int(frame["block_io_count"].sum())
    print(f"requests {len(frame)}  spans {len(run.spans)}  block I/Os {len(run.block_io)} "
          f"(joined {joined})  make_run {made:.1f} s")
    print(f"load_run {load:.2f} s  parquet-only load {parquet:.2f} s  attribute {attribute:.2f} s")
    print(f"ratio attribute / load_run      = {attribute / load:.3f}")
    print(f"ratio attribute / parquet-only  = {attribute / parquet:.3f}  (target <= 3)")
    waited = shared[[c for c in shared.columns if c.startswith("batch_")]].sum(axis=1)
    print(f"one shared worker: attribute {attribute_shared:.2f} s, {int((waited > 0).sum())} "
          f"requests waited on the batch; ratio / parquet-only = {attribute_shared / parquet:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
