"""`kvscope check RUN --baseline FILE`: the TTFT regression gate (exit 1 on regression)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check", help="fail (exit 1) when a TTFT component regressed against a baseline",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  kvscope check runs/new --baseline ci/ttft-baseline.json --junit out.xml\n"
               "  kvscope check runs/good --baseline ci/ttft-baseline.json --write-baseline "
               "--phase cold --tolerance 0.15")
    parser.add_argument("run", help="run directory")
    parser.add_argument("--baseline", required=True, help="baseline JSON file")
    parser.add_argument("--write-baseline", action="store_true",
                        help="write the baseline from this run instead of checking")
    parser.add_argument("--phase", help="with --write-baseline: phase to gate (default: all)")
    parser.add_argument("--stat", default="p50", choices=("p50", "p90", "mean"))
    parser.add_argument("--tolerance", type=float, default=0.10,
                        help="with --write-baseline: allowed relative increase (default 0.10)")
    parser.add_argument("--junit", help="also write the result as JUnit XML here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from analysis import gate, outputs

    try:
        attribution = outputs.load_attribution(args.run)
        if args.write_baseline:
            baseline = gate.baseline_from(attribution, phase=args.phase, stat=args.stat,
                                          tolerance=args.tolerance)
            Path(args.baseline).write_text(json.dumps(baseline, indent=2))
            print(f"wrote {args.baseline} ({len(baseline['components'])} components)")
            return 0
        result = gate.check(attribution, gate.read_baseline(args.baseline))
    except (FileNotFoundError, ValueError) as e:
        print(f"kvscope check: {e}", file=sys.stderr)
        return 2
    print(f"{'component':24} {'baseline s':>11} {'current s':>11} {'limit s':>11} {'change':>8}  status")
    for r in result.itertuples():
        print(f"{r.component:24} {r.baseline_s:11.4f} {r.current_s:11.4f} {r.limit_s:11.4f} "
              f"{r.change:+8.1%}  {r.status}")
    if args.junit:
        Path(args.junit).write_text(gate.junit_xml(result, f"kvscope-check {Path(args.run).name}"))
    regressed = int((result["status"] != "ok").sum())
    print(f"{regressed} regression(s)" if regressed else "no regression")
    return 1 if regressed else 0
