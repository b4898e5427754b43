"""`kvscope dashboard RUN [RUN ...]`: the Dash app over one or more run directories."""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  kvscope dashboard runs/serial runs/parallel     # two runs side by side, http://127.0.0.1:8050
  kvscope dashboard runs/cold --port 8060 --jaeger-url http://127.0.0.1:16686
  kvscope dashboard runs/a --host 0.0.0.0          # reachable from other hosts (no auth!)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dashboard", help="open the TTFT breakdown dashboard on one or more runs",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories to show")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8050, help="port (default 8050)")
    parser.add_argument("--jaeger-url", default=None,
                        help="Jaeger UI base URL; requests then link to {url}/trace/{trace_id}")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvscope.dashboards.app import create_app
    from kvscope.dashboards.data import DashboardError

    try:
        app = create_app(args.runs, jaeger_url=args.jaeger_url)
    except DashboardError as e:
        print(f"kvscope dashboard: {e}", file=sys.stderr)
        return 2
    print(f"kvscope dashboard: serving {len(args.runs)} run(s) on http://{args.host}:{args.port}/")
    app.run(host=args.host, port=args.port, debug=False)
    return 0
