"""`kvscope analyze RUN`: TTFT attribution, summary and report written into the run."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze", help="split every request's TTFT into components; write the report",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  kvscope analyze runs/parallel    # attribution.parquet, summary.json,"
               " report.md, plots/\n  kvscope analyze runs/x --no-plots")
    parser.add_argument("run", help="run directory")
    parser.add_argument("--no-plots", action="store_true", help="skip report.md and plots/")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvscope.analysis import outputs, report
    from kvscope.contract.files import UnsafePath
    from kvscope.contract.rundir import RunDirError

    try:
        attribution, summary = outputs.analyze(args.run, plots=not args.no_plots)
    except (FileNotFoundError, RunDirError, UnsafePath) as e:
        print(f"kvscope analyze: {e}", file=sys.stderr)
        return 2
    r = summary["requests"]
    print(f"{args.run}: {r['total']} requests, {r['complete']} complete, {r['partial']} partial, "
          f"{r['failed']} failed")
    for g in summary["groups"]:
        p50 = g["percentiles_ns"]
        parts = ", ".join(f"{k} {v['p50'] / 1e6:.1f}" for k, v in p50.items() if v)
        print(f"  {g['phase']} (conc {g['concurrency']}, n={g['requests']}) p50 ms: {parts}")
    for line in report.ledger_lines(summary.get("chunk_ledger")):
        if line:
            print(f"  {line}")
    for f in summary["findings"]:
        print(f"  [{f['severity']}] {f['id']}: {f['message']}")
    return 0
