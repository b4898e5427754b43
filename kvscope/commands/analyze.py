"""`kvscope analyze RUN`: TTFT attribution, summary and report written into the run;
`kvscope analyze --out DIR RUN...`: many runs (a fleet), in this process or on Dask."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze", help="split every request's TTFT into components; write the report",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  kvscope analyze runs/parallel    # attribution.parquet, summary.json,"
               " report.md, plots/\n  kvscope analyze runs/x --no-plots\n"
               "  kvscope analyze --out fleet/ /shared/runs/*    # every run, one after another\n"
               "  kvscope analyze --engine dask --scheduler tcp://sched:8786 --out fleet/ "
               "/shared/runs/*\n"
               "      # fleet/parts/*.parquet: every request, labelled; fleet/fleet_summary.parquet:"
               " per server, device, backend, hour")
    parser.add_argument("run", nargs="+", help="run directory (or its spans.parquet)")
    parser.add_argument("--no-plots", action="store_true", help="skip report.md and plots/")
    parser.add_argument("--out", help="fleet mode: write every run's rows and the fleet summary "
                        "here (needed for more than one run or an --engine)")
    parser.add_argument("--engine", choices=("local", "dask"),
                        help="fleet mode: where the runs are analysed (default local: here)")
    parser.add_argument("--scheduler", help="dask: the scheduler's address (default: a local "
                        "cluster of --workers processes)")
    parser.add_argument("--workers", type=int, default=2,
                        help="dask without --scheduler: worker processes (default 2)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    runs = [args.run] if isinstance(args.run, str) else args.run  # callers may name one run
    if getattr(args, "out", None) or getattr(args, "engine", None) or len(runs) > 1:
        return _fleet(args, runs)
    from kvscope.analysis import outputs, report
    from kvscope.contract.files import UnsafePath
    from kvscope.contract.rundir import RunDirError

    try:
        attribution, summary = outputs.analyze(runs[0], plots=not args.no_plots)
    except (FileNotFoundError, RunDirError, UnsafePath) as e:
        print(f"kvscope analyze: {e}", file=sys.stderr)
        return 2
    r = summary["requests"]
    print(f"{runs[0]}: {r['total']} requests, {r['complete']} complete, {r['partial']} "
          f"partial, {r['failed']} failed")
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


def _fleet(args: argparse.Namespace, runs: list[str]) -> int:
    from kvscope.analysis import fleet

    if not getattr(args, "out", None):
        print("kvscope analyze: several runs or --engine need --out DIR for the fleet tables",
              file=sys.stderr)
        return 2
    try:
        summary = fleet.analyze(runs, args.out, engine=args.engine or "local",
                                scheduler=args.scheduler, workers=args.workers)
    except FileNotFoundError as e:
        print(f"kvscope analyze: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("kvscope analyze: --engine dask needs Dask: pip install 'kvscope[dask]'",
              file=sys.stderr)
        return 2
    print(f"{len(runs)} runs -> {args.out}/parts/ (every request), "
          f"{args.out}/fleet_summary.parquet")
    print(summary.to_string(index=False, float_format="{:.3g}".format))
    return 0
