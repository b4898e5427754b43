"""Benchmark: TTFT median with tracing on vs off at concurrency 16 (target ratio <= 1.02).

    .venv/bin/python bench/tracing_overhead.py [--repeats 2] [--requests 48] [--phases warm,cold]

Runs the same `kvscope run` workload (tiny twin by default, stock backend, probes off) alternately with
`--no-tracing` and `--tracing`, `--repeats` times each, so slow drift of the shared machine
hits both sides alike. Prints per phase the pooled TTFT median and p90 of each side, the
on/off ratio of the medians, and the spans written per request. `cold` needs root (it drops
the page cache).
"""

from __future__ import annotations

import argparse
import socket
import tempfile
from pathlib import Path

import pandas as pd

import analysis
from kvscope import rundir
from kvscope.workload.runner import RunOptions, execute
from kvscope.workload.server import ServerError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _execute(out: Path, tracing: bool, args: argparse.Namespace, attempts: int = 3) -> Path:
    """One run; a port taken between choosing and binding it (shared machine) is retried."""
    for attempt in range(attempts):
        target = out.with_name(f"{out.name}-{attempt}")
        opts = RunOptions(out=target, model=args.model, requests=args.requests,
                          concurrency=[args.concurrency], prompt_tokens=args.prompt_tokens,
                          phases=args.phases.split(","), kv_dir=out.with_name(out.name + "-kv"),
                          port=_free_port(), probes=False, tracing=tracing)
        try:
            return execute(opts)
        except ServerError as e:
            if "Address already in use" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _one(out: Path, tracing: bool, args: argparse.Namespace) -> pd.DataFrame:
    run = _execute(out, tracing, args)
    requests = rundir.read_table(run, "requests")
    failed = int((requests["status"] != "ok").sum())
    if failed:
        raise SystemExit(f"{failed} requests failed in {run}; see {run / 'server.log'}")
    requests["tracing"] = tracing
    requests["run"] = out.name
    if tracing:
        spans = analysis.load_run(run).spans
        requests["spans"] = requests["request_id"].map(spans.groupby("request_id").size())
    return requests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--model", default="tiny")
    p.add_argument("--phases", default="warm,cold")
    args = p.parse_args(argv)
    frames = []
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as tmp:
        for i in range(args.repeats):
            for tracing in (False, True):
                out = Path(tmp) / f"r{i}-{'on' if tracing else 'off'}"
                frames.append(_one(out, tracing, args))
    table = pd.concat(frames, ignore_index=True)
    print(f"{args.model} twin, concurrency {args.concurrency}, {args.requests} requests per phase, "
          f"{args.repeats} runs per side, alternating")
    for phase, rows in table.groupby("phase"):
        ttft = rows.groupby("tracing")["ttft_s"]
        off, on = ttft.median()[False], ttft.median()[True]
        p90 = ttft.quantile(0.9)
        spans = rows.loc[rows["tracing"], "spans"]
        print(f"{phase:>5}: TTFT median off {off * 1e3:7.2f} ms  on {on * 1e3:7.2f} ms  "
              f"ratio {on / off:.3f}   p90 off {p90[False] * 1e3:7.2f} ms  "
              f"on {p90[True] * 1e3:7.2f} ms   spans/request {spans.mean():.1f} "
              f"(min {spans.min():.0f}, max {spans.max():.0f})")
    runs = table.groupby(["phase", "run"], sort=False)["ttft_s"].median() * 1e3
    best = runs.groupby([runs.index.get_level_values("phase"),
                         runs.index.get_level_values("run").str.contains("-on")]).min()
    for phase in best.index.get_level_values(0).unique():
        print(f"{phase:>5}: best run median off {best[(phase, False)]:.1f} ms, on "
              f"{best[(phase, True)]:.1f} ms, ratio {best[(phase, True)] / best[(phase, False)]:.3f}"
              " (least disturbed runs; robust to a busy machine)")
    print("per-run TTFT medians (ms), in run order:",
          ", ".join(f"{phase}/{run} {ms:.1f}" for (phase, run), ms in runs.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
