"""`kvscope check`: the TTFT regression gate (RUN --baseline FILE) and the acceptance gates
(CANDIDATE... --against BASELINE... --gates FILE, one run of each per repetition); exit 1 when a
gate fails or cannot tell (one repetition), 2 on bad input."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvscope.contract import files

EPILOG = """examples:
  kvscope check runs/new --baseline ci/ttft-baseline.json --junit out.xml
  kvscope check runs/good --baseline ci/ttft-baseline.json --write-baseline --phase cold --tolerance 0.15
  kvscope check runs/demo-X/kvscope-r* --against runs/demo-X/kvscope-serial-r* \\
      --gates analysis/gates/seeds-g3.json --junit gates.xml     # the seeds' G3 gates
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check", help="fail (exit 1) on a TTFT regression, or when a candidate run misses its "
        "acceptance gates against a baseline run", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", nargs="+", help="run directory; with --gates the candidate's, "
                        "one per repetition of the study (paired in order with --against)")
    parser.add_argument("--baseline", help="baseline JSON file of the regression gate")
    parser.add_argument("--write-baseline", action="store_true",
                        help="write the baseline from this run instead of checking")
    parser.add_argument("--phase", help="with --write-baseline: phase to gate (default: all)")
    parser.add_argument("--stat", default="p50", choices=("p50", "p90", "mean"))
    parser.add_argument("--tolerance", type=float, default=0.10,
                        help="with --write-baseline: allowed relative increase (default 0.10)")
    parser.add_argument("--gates", help="acceptance gate file (JSON; e.g. analysis/gates/seeds-g3.json)")
    parser.add_argument("--against", nargs="+",
                        help="with --gates: the baseline's run directories, one per repetition; "
                        "a gate passes only when its interval across repetitions clears the "
                        "bound, and one repetition (spread unknown) passes none")
    parser.add_argument("--junit", help="also write the result as JUnit XML here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (bool(args.gates) == bool(args.baseline) or bool(args.gates) != bool(args.against)
            or (args.baseline and len(args.run) > 1)
            or (args.gates and len(args.run) != len(args.against))):
        print("kvscope check: give either RUN --baseline FILE (regression gate) or "
              "CANDIDATE... --gates FILE --against BASELINE... with as many baseline runs as "
              "candidate runs (acceptance gates)", file=sys.stderr)
        return 2
    try:
        return _gates(args) if args.gates else _regression(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"kvscope check: {e}", file=sys.stderr)
        return 2


def _regression(args: argparse.Namespace) -> int:
    from kvscope.analysis import gate, outputs

    [run] = args.run
    attribution = outputs.load_attribution(run)
    if args.write_baseline:
        baseline = gate.baseline_from(attribution, phase=args.phase, stat=args.stat,
                                      tolerance=args.tolerance)
        files.atomic_write(args.baseline, json.dumps(baseline, indent=2), files.OUTPUT_FILE_MODE)
        print(f"wrote {args.baseline} ({len(baseline['components'])} components)")
        return 0
    result = gate.check(attribution, gate.read_baseline(args.baseline))
    print(f"{'component':24} {'baseline s':>11} {'current s':>11} {'limit s':>11} {'change':>8}  status")
    for r in result.itertuples():
        print(f"{r.component:24} {r.baseline_s:11.4f} {r.current_s:11.4f} {r.limit_s:11.4f} "
              f"{r.change:+8.1%}  {r.status}")
    if args.junit:
        files.atomic_write(args.junit,
                           gate.junit_xml(result, f"kvscope-check {Path(run).name}"),
                           files.OUTPUT_FILE_MODE)
    regressed = int((result["status"] != "ok").sum())
    print(f"{regressed} regression(s)" if regressed else "no regression")
    return 1 if regressed else 0


def _load(path: str) -> dict:
    from kvscope.analysis import outputs
    from kvscope.contract import rundir

    requests = rundir.read_table(Path(path), "requests")
    if requests is None:
        raise ValueError(f"{path} has no requests.parquet: pass a run directory of `kvscope run`")
    return {"attribution": outputs.load_attribution(path), "requests": requests}


def _gates(args: argparse.Namespace) -> int:
    from kvscope.analysis import acceptance, gate

    gates = acceptance.read_gates(args.gates)
    result = acceptance.check(gates, [(_load(b), _load(c))
                                      for b, c in zip(args.against, args.run)])
    print(f"{gates.get('name', args.gates)}: {' '.join(args.run)} against "
          f"{' '.join(args.against)}")
    for r in result.itertuples():
        print(f"  {r.status:7}  {r.gate}: {r.value:.4f} (needs {acceptance.bounds(r)}; "
              f"{acceptance.spread_words(r)}; first repetition: {r.detail})")
    if args.junit:
        files.atomic_write(args.junit, gate.junit(
            f"kvscope-gates {Path(args.run[0]).name}",
            [(str(r.gate), acceptance.failure_message(r) if r.status != "pass" else None)
             for r in result.itertuples()]), files.OUTPUT_FILE_MODE)
    failed = int((result["status"] != "pass").sum())
    print(f"{failed} of {len(result)} gates failed or could not tell" if failed
          else f"all {len(result)} gates pass")
    return 1 if failed else 0
