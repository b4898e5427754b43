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
    from kvscope.contract import files

    output = args.output or args.run / DEFAULT_NAMES[args.format]
    try:
        _check_output(output)
        text = _build(args.format, args.run)
        files.atomic_write(output, text)
    except (OSError, ValueError) as e:
        print(f"kvscope export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    return 0


def _check_output(output: Path) -> None:
    """Refuse an output that cannot be written before the (possibly long) conversion."""
    if output.is_dir():
        raise ValueError(f"-o {output} is a directory; name a file in it, e.g. "
                         f"{output / 'trace.json'}")
    if not output.parent.is_dir():
        raise ValueError(f"-o {output}: its directory {output.parent} does not exist; "
                         f"create it first or name a file elsewhere")


def _build(fmt: str, run_dir: Path) -> str:
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a run directory")
    if fmt == "otlp":
        from kvscope.contract import otlp_json
        from kvscope.exports.merge import merged_otlp

        return otlp_json.dumps(merged_otlp(run_dir))
    from kvscope.analysis import load_run
    from kvscope.exports.perfetto import chrome_trace

    return json.dumps(chrome_trace(load_run(run_dir).spans), separators=(",", ":"))
