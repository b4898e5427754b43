"""`kvscope export`: a run's spans for other tools (Perfetto, Jaeger)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXAMPLES = """examples:
  kvscope export perfetto runs/smoke            # -> runs/smoke/trace.perfetto.json (ui.perfetto.dev)
  kvscope export otlp runs/smoke -o smoke.json  # one OTLP JSON file for Jaeger's "Upload JSON"
"""
DEFAULT_NAMES = {"perfetto": "trace.perfetto.json", "otlp": "trace.otlp.json"}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export", help="write a run's spans as Perfetto (Chrome JSON) or one OTLP JSON file",
        description="Convert RUN/spans/*.json: `perfetto` writes Chrome trace-event JSON "
        "(overlapping storage reads as async events, reads in flight as a counter); `otlp` "
        "merges the span files into one OTLP JSON document that Jaeger's UI can open.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("format", choices=sorted(DEFAULT_NAMES), help="output format")
    p.add_argument("run", type=Path, help="run directory")
    p.add_argument("-o", "--output", type=Path,
                   help="output file (default RUN/trace.perfetto.json or RUN/trace.otlp.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        document = _build(args.format, args.run)
    except (FileNotFoundError, ValueError) as e:
        print(f"kvscope export: error: {e}", file=sys.stderr)
        return 2
    output = args.output or args.run / DEFAULT_NAMES[args.format]
    output.write_text(json.dumps(document, separators=(",", ":")))
    print(f"wrote {output}")
    return 0


def _build(fmt: str, run_dir: Path) -> dict:
    if fmt == "otlp":
        from kvscope.exports.merge import merged_otlp

        if not run_dir.is_dir():
            raise FileNotFoundError(f"{run_dir} is not a run directory")
        return merged_otlp(run_dir)
    from kvscope.analysis import load_run
    from kvscope.exports.perfetto import chrome_trace

    return chrome_trace(load_run(run_dir).spans)
