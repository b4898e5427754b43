"""`kvscope model make NAME DIR`: a local model twin with a real model's KV geometry."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="make KV-geometry twin models")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    make = actions.add_parser(
        "make",
        help="write a local Hugging Face model directory with a real model's KV geometry",
        epilog="example: kvscope model make qwen2.5-32b models/qwen2.5-32b",
    )
    make.add_argument("name", help="twin name (see `kvscope model list`)")
    make.add_argument("dir", help="output directory (reused if it already holds this twin)")
    make.set_defaults(func=_make)
    listing = actions.add_parser("list", help="list the twins and their KV sizes")
    listing.set_defaults(func=_list)


def _make(args: argparse.Namespace) -> int:
    from kvscope.capture import twins

    spec = twins.get(args.name)
    path, made = twins.make(spec, args.dir)
    print(f"{'made' if made else 'reused'} {spec.name} twin at {path}")
    print(twins.describe(spec))
    return 0


def _list(args: argparse.Namespace) -> int:
    from kvscope.capture import twins

    for spec in twins.TWINS.values():
        print(twins.describe(spec))
    return 0
