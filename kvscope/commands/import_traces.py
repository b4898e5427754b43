"""`kvscope import SOURCE --out RUN`: a run directory from trace files or Jaeger."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXAMPLES = """examples:
  kvscope import traces.json --out runs/imported          # OTLP JSON, or Jaeger's UI download
  kvscope import /var/otel/traces.jsonl --out runs/col     # the Collector's file exporter
  kvscope import --url http://jaeger:16686 --service kvscope-vllm --since 600 --out runs/j
then: kvscope analyze runs/imported
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "import", help="make a run directory from OTLP / Jaeger traces (files or Jaeger's API)",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", type=Path, help="a trace file or a directory of them")
    parser.add_argument("--url", help="Jaeger's query URL: fetch from its /api/v3/traces")
    parser.add_argument("--service", default="kvscope-vllm",
                        help="service to fetch with --url (default kvscope-vllm)")
    parser.add_argument("--since", type=float, default=3600.0,
                        help="seconds back from now to fetch with --url (default 3600)")
    parser.add_argument("--limit", type=int, default=1000,
                        help="most traces to fetch with --url (default 1000)")
    parser.add_argument("--out", required=True, type=Path, help="new run directory")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvscope.contract import rundir
    from kvscope.capture.trace_import import documents, importing

    if (args.source is None) == (args.url is None):
        print("kvscope import: give either a trace file/directory or --url", file=sys.stderr)
        return 2
    try:
        if args.url:
            source = f"{args.url} (service {args.service}, last {args.since:.0f} s)"
            messages = importing.fetch_v3(args.url, args.service, args.since, args.limit)
        else:
            if not args.source.exists():
                raise documents.TraceImportError(f"{args.source}: no such file or directory")
            source = str(args.source)
            messages = documents.read(args.source)
        found = importing.write_run(args.out, messages, source)
    except (documents.TraceImportError, rundir.RunDirError) as e:
        print(f"kvscope import: {e}", file=sys.stderr)
        return 2
    left_out = (f"; {found.backwards} spans that end before they start were left out"
                if found.backwards else "")
    print(f"kvscope import: {found.spans} spans, {found.requests} requests, phases "
          f"{', '.join(found.phases)} into {found.run}{left_out}; next: kvscope analyze "
          f"{found.run}")
    return 0
