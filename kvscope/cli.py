"""The `kvscope` command: a thin dispatcher over one module per subcommand.

Each module in COMMANDS defines `register(subparsers)`, which adds its parser and sets
`func=run` where `run(args) -> int`. Modules import heavy packages (torch, vllm, bcc) inside
`run`, so `kvscope --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = (
    "kvscope.commands.analyze",
    "kvscope.commands.check",
    "kvscope.commands.compare",
    "kvscope.commands.dashboard",
    "kvscope.commands.demo",
    "kvscope.commands.export",
    "kvscope.commands.import_traces",
    "kvscope.commands.model",
    "kvscope.commands.probe",
    "kvscope.commands.record",
    "kvscope.commands.run",
    "kvscope.commands.tune",
    "kvscope.commands.whatif",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscope",
        description="See where an LLM server's time-to-first-token goes when its KV cache "
        "lives on disk, and make the read path fast.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("kvscope: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
