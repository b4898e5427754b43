"""`kvscope whatif`: the TTFT model beside published numbers, or fitted to a run."""

from __future__ import annotations

import argparse
from typing import Any
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "whatif", help="model TTFT from KV size, concurrency, bandwidth and prefill rate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  kvscope whatif                       # model vs published studies\n"
               "  kvscope whatif --run runs/serial --read-gbps 5.23   # fit a run, change bw")
    parser.add_argument("--run", help="fit the model to this run instead")
    parser.add_argument("--read-gbps", type=float, help="with --run: predict at this read GB/s")
    parser.add_argument("--concurrency", type=int, help="with --run: predict at this concurrency")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvscope.analysis import whatif

    if args.run:
        return _fit(args)
    table = whatif.published_table()
    for study, rows in table.groupby("study", sort=False):
        print(f"## {study}")
        r: Any  # a row of the published table (pandas types its fields as any scalar)
        for r in rows.itertuples():
            model = "" if r.model is None or r.model != r.model else f"model {r.model:g}"
            print(f"- [{r.kind}] {r.case}: published {r.published}; {model} {r.error}".rstrip())
            if r.note:
                print(f"    {r.note}")
    return 0


def _fit(args: argparse.Namespace) -> int:
    from kvscope.analysis import load_run, outputs, whatif

    try:
        run = load_run(args.run)
        kv = int(run.manifest.get("model", {}).get("kv_bytes_per_token", 0))
        if kv <= 0:
            raise ValueError(f"{args.run}: manifest model.kv_bytes_per_token is missing")
        inputs, error = whatif.fit_run(outputs.load_attribution(args.run), run.requests, kv)
    except (FileNotFoundError, ValueError) as e:
        print(f"kvscope whatif: {e}", file=sys.stderr)
        return 2
    print(f"fitted: {inputs}")
    print(f"model TTFT {whatif.predict(inputs)['ttft_s']:.3f} s, {error:+.1%} vs the run's median")
    changes = {k: v for k, v in (("read_bw", args.read_gbps and args.read_gbps * 1e9),
                                 ("concurrency", args.concurrency)) if v}
    if changes:
        print(f"what if {changes}: {whatif.scale(inputs, **changes)}")
    return 0
