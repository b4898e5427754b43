"""`kvscope run`: drive a live vLLM + LMCache server through warm and cold phases."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run a warm/cold workload against a live server")
    parser.set_defaults(func=lambda args: 2)
