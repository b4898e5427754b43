"""`kvscope compare A B`: per-component deltas and speedups of B over A, with bootstrap CIs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare", help="compare two runs component by component (serial vs parallel)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  kvscope compare runs/serial runs/parallel --phase cold\n"
               "  kvscope compare A B --stat mean --json")
    parser.add_argument("a", help="baseline run directory (A)")
    parser.add_argument("b", help="candidate run directory (B)")
    parser.add_argument("--phase", help="compare only this phase (default: all)")
    parser.add_argument("--stat", default="p50", choices=("p50", "p90", "mean"))
    parser.add_argument("--boot", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--json", action="store_true", help="print JSON records")
    parser.set_defaults(func=run)


def rates(a: str, b: str, phase: str | None, n_boot: int):
    """B's throughput over A's per phase both runs have (or `phase`), with 95 % CIs."""
    import pandas as pd

    from kvscope.analysis import throughput
    from kvscope.contract import rundir

    ra, rb = (rundir.read_table(Path(p), "requests") for p in (a, b))
    if ra is None or rb is None:
        return pd.DataFrame()
    phases = [phase] if phase else [p for p in dict.fromkeys(ra["phase"]) if p in set(rb["phase"])]
    return pd.concat([throughput.ratio(ra, rb, p, n_boot=n_boot) for p in phases],
                     ignore_index=True)


def run(args: argparse.Namespace) -> int:
    from kvscope.analysis import compare, outputs

    try:
        table = compare.compare(outputs.load_attribution(args.a), outputs.load_attribution(args.b),
                                phase=args.phase, stat=args.stat, n_boot=args.boot)
        throughput = rates(args.a, args.b, args.phase, args.boot)
    except (FileNotFoundError, ValueError) as e:
        print(f"kvscope compare: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"components": table.to_dict(orient="records"),
                          "throughput": throughput.to_dict(orient="records")}, indent=2))
        return 0
    print(f"{args.stat} per component, A={args.a}  B={args.b}  (95 % bootstrap CI)")
    print(f"{'component':24} {'A (s)':>9} {'B (s)':>9} {'B-A (s)':>22} {'speedup A/B':>22}")
    for r in table.itertuples():
        print(f"{r.component:24} {r.a_s:9.4f} {r.b_s:9.4f} "
              f"{r.delta_s:+8.4f} [{r.delta_lo:+.3f},{r.delta_hi:+.3f}] "
              f"{r.speedup:7.2f}x [{r.speedup_lo:.2f},{r.speedup_hi:.2f}]")
    if not throughput.empty:
        print(f"\nthroughput per phase (B / A, 95 % bootstrap CI)")
        print(f"{'phase':12} {'metric':22} {'A':>10} {'B':>10} {'B/A':>18}")
        for r in throughput.itertuples():
            print(f"{r.phase:12} {r.metric:22} {r.a:10.2f} {r.b:10.2f} "
                  f"{r.ratio:7.2f}x [{r.ratio_lo:.2f},{r.ratio_hi:.2f}]")
    return 0
