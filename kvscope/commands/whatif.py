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
               "  kvscope whatif --run runs/serial --read-gbps 5.23   # fit a run, change bw\n"
               "  kvscope whatif --run runs/kvscope --against runs/kvscope-serial --phase cold")
    parser.add_argument("--run", help="fit the model to this run instead")
    parser.add_argument("--read-gbps", type=float, help="with --run: predict at this read GB/s")
    parser.add_argument("--concurrency", type=int, help="with --run: predict at this concurrency")
    parser.add_argument("--against", metavar="RUN",
                        help="with --run: another read path's run of the same workload (e.g. "
                             "kvscope-serial against kvscope); predict its TTFT and storage "
                             "read over --run's from --run's fit at RUN's read GB/s, beside "
                             "the measured ratios")
    parser.add_argument("--phase", help="with --run: fit only this phase's requests (e.g. cold)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvscope.analysis import whatif

    if args.run:
        return _fit(args)
    if args.against or args.phase:
        print("kvscope whatif: --against and --phase need --run RUN, the run to fit",
              file=sys.stderr)
        return 2
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
    from kvscope.analysis import whatif

    try:
        inputs, error, attribution = _fitted(args.run, args.phase)
        other = _fitted(args.against, args.phase) if args.against else None
    except (FileNotFoundError, ValueError) as e:
        print(f"kvscope whatif: {e}", file=sys.stderr)
        return 2
    print(f"fitted: {inputs}")
    print(f"model TTFT {whatif.predict(inputs)['ttft_s']:.3f} s, {error:+.1%} vs the run's median")
    changes = {k: v for k, v in (("read_bw", args.read_gbps and args.read_gbps * 1e9),
                                 ("concurrency", args.concurrency)) if v}
    if changes:
        print(f"what if {changes}: {whatif.scale(inputs, **changes)}")
        measured_ttft_s = whatif.medians(attribution)["ttft"]
        slower = whatif.slowdown(inputs, measured_ttft_s, **changes)
        print(f"  over the run's median: TTFT {slower['ttft']:.2f}x, storage read "
              f"{slower['storage']:.2f}x")
    if other is not None:
        other_inputs, _, other_attribution = other
        predicted = whatif.slowdown(inputs, whatif.medians(attribution)["ttft"],
                                    read_bw=other_inputs.read_bw)
        measured = whatif.measured_slowdown(other_attribution, attribution)
        print(f"{args.against} over {args.run} at {other_inputs.read_bw / 1e9:.3f} against "
              f"{inputs.read_bw / 1e9:.3f} GB/s read:")
        for part in ("ttft", "storage"):
            print(f"  {part}: predicted {predicted[part]:.2f}x, measured {measured[part]:.2f}x, "
                  f"error {predicted[part] / measured[part] - 1:+.1%}")
    return 0


def _fitted(path: str, phase: str | None) -> tuple[Any, float, Any]:
    """The what-if inputs of a run (of one phase's requests), the fit's error, the attribution.

    Raises:
        ValueError: the run cannot be read, has no such phase, or nothing to fit.
        FileNotFoundError: the run directory or one of its tables is missing.
    """
    from kvscope.analysis import load_run, outputs, whatif

    run = load_run(path)
    kv = int(run.manifest.get("model", {}).get("kv_bytes_per_token", 0))
    if kv <= 0:
        raise ValueError(f"{path}: manifest model.kv_bytes_per_token is missing")
    attribution = outputs.load_attribution(path)
    if phase is not None:
        attribution = attribution[attribution["phase"] == phase]
        if attribution.empty:
            raise ValueError(f"{path}: no request of phase {phase!r}; pick one the run has "
                             f"({', '.join(sorted(set(run.requests['phase'])))})")
    inputs, error = whatif.fit_run(attribution, run.requests, kv)
    return inputs, error, attribution
