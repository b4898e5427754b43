"""Benchmark of the live CPU stack (issue: live CPU stack).

For each backend profile, one run of the qwen2.5-32b twin: engine start time, then warm and cold
TTFT medians at concurrency 1 and 16 with 1024-token prompts, and bytes read per phase. Profiles
run one after another in this process, so the table compares them side by side.

    .venv/bin/python bench/live_stack.py [--profiles stock-serial,stock] [--requests 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd

from kvscope.contract import rundir
from kvscope.capture.workload.options import RunOptions
from kvscope.capture.workload.runner import execute


def summarize(run: Path) -> pd.DataFrame:
    manifest = rundir.read_manifest(run)
    requests = rundir.read_table(run, "requests")
    rows = []
    for phase in manifest["phases"]:
        ok = requests[(requests["phase"] == phase["name"]) & (requests["status"] == "ok")]
        seconds = (phase["ended_ns"] - phase["started_ns"]) / 1e9
        rows.append({
            "profile": manifest["backend"]["profile"],
            "startup_s": manifest["server"]["startup_s"],
            "phase": phase["name"], "conc": phase["concurrency"],
            "ttft_p50_s": ok["ttft_s"].median(), "ttft_p99_s": ok["ttft_s"].quantile(0.99),
            "errors": phase["num_errors"],
            "read_GiB": phase["disk_read_bytes"] / 2**30,
            "read_GBps": phase["disk_read_bytes"] / 1e9 / seconds,
        })
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", default="stock-serial,stock")
    parser.add_argument("--model", default="qwen2.5-32b")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="kvscope-bench-")))
    parser.add_argument("--port", type=int, default=8190)
    args = parser.parse_args(argv)
    tables = []
    for profile in args.profiles.split(","):
        run = execute(RunOptions(
            out=args.out / profile, model=args.model, profile=profile, requests=args.requests,
            concurrency=[1, 16], prompt_tokens=args.prompt_tokens, port=args.port,
            command=sys.argv,
        ))
        tables.append(summarize(run))
    table = pd.concat(tables, ignore_index=True)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    cold16 = table[table["phase"] == "cold-c16"].set_index("profile")["ttft_p50_s"]
    if len(cold16) > 1:
        base = cold16.iloc[0]
        for profile, value in cold16.items():
            print(f"cold TTFT p50 at c=16, {profile} / {cold16.index[0]}: {value / base:.2f}x")
    print(f"runs: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
