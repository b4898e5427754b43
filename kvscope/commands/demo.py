"""`kvscope demo`: the serial-vs-parallel study on the live stack, end to end, with its report."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

EXAMPLES = """examples:
  kvscope demo                                   # prints its estimate first (a short calibration)
  kvscope demo --requests 4 --concurrency 1,4 --repeats 1   # a quick look, no spread
  kvscope demo --repeats 4 --order random --seed 7   # four blocks, each in a drawn order
  kvscope demo --requests 32 --concurrency 8,16,32 --prompt-tokens 8192   # a bigger host
"""
HEADLINE_COLUMNS = ["profile", "conc", "ttft_p50_s", "ttft_p99_s", "storage_read_p50_s",
                    "transfer_p50_s", "prefill_p50_s", "read_GBps", "ceiling_GBps",
                    "req_per_s", "storage_tok_per_s", "speedup_vs_serial", "throughput_vs_serial",
                    "bound", "reps"]


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvscope.capture.workload import device
    from kvscope.commands.run import _levels
    from kvscope.study_options import ORDERS, StudyOptions

    d = StudyOptions(out=Path("."))
    p = subparsers.add_parser(
        "demo", help="run the KV read study on the live stack: kvscope serial and parallel, LMCache's "
        "stock disk tier and its other disk paths that run here",
        description="For each backend profile: a warm phase and cold phases at each concurrency "
        "level with tracing and probes on, repeated in interleaved blocks; then analysis, every "
        "ratio with its interval across repetitions, and the study report. A comparison is "
        "called level when that interval includes 1, and nobody wins with one repetition.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="study directory (default runs/demo-<time>)")
    p.add_argument("--model", default=d.model)
    p.add_argument("--profiles", default=",".join(d.profiles),
                   help="comma-separated backend profiles (default: kvscope's two, LMCache's "
                   "stock and every other LMCache disk path that runs here)")
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrency", type=_levels, default=d.concurrency)
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--kv-dir-base", type=Path,
                   help="put each profile's chunk files under this directory (the disk to measure)")
    p.add_argument("--device", default=d.device, help=device.help_text())
    p.add_argument("--no-shared-warm", dest="share_warm", action="store_false",
                   help="give every profile its own warm phase (by default profiles of one chunk "
                   "format share the first one's: same chunks on disk, read cold by each)")
    p.add_argument("--repeats", type=_positive, default=d.repeats,
                   help="runs of each profile, one per block of the study (default %(default)s): "
                   "each ratio gets a 95 %% interval across them; with 1 the run-to-run spread is "
                   "unknown and the headline calls no winner")
    p.add_argument("--order", choices=ORDERS, default=d.order,
                   help="the blocks' order: abba reverses each block after the one before, "
                   "random draws each from --seed (default %(default)s); study.json records it")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of --order random")
    p.set_defaults(func=run)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _ceiling_words(runs: dict[str, Path]) -> str:
    """The study's measured ceiling on the device its runs read (one device per study)."""
    from kvscope.contract import rundir

    measured = rundir.read_manifest(next(iter(runs.values()))).get("study", {}).get(
        "device_ceiling")
    if not measured:
        return "its ceiling could not be measured"
    return (f"ceiling {measured['bytes_per_s'] / 1e9:.2f} GB/s ({measured['unit'] >> 10} KiB "
            f"reads, {measured['depth']} in flight)")


def _print_findings(reps: list[dict[str, Path]], table: pd.DataFrame,
                    summary: pd.DataFrame) -> None:
    """The headline over repetitions, every ratio against serial with where it stands, what
    limits the gain, kvscope against the other paths, and the first repetition's targets."""
    from kvscope.analysis import (study_peers, study_repeats, study_tables, study_targets,
                                  study_verdict)
    from kvscope.contract.study_roles import BASELINE

    runs = reps[0]
    print("\n" + table[HEADLINE_COLUMNS].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if compared := study_repeats.lines(summary):
        print(f"\nagainst {BASELINE}, over {len(reps)} repetition(s):\n" + "\n".join(compared))
    print("\n" + "\n".join(study_verdict.verdict(table, runs, summary)))
    if peers := study_peers.peer_verdicts(table, summary):
        print("\nkvscope against the other disk paths:\n" + "\n".join(peers))
    targets = study_targets.target_rows(runs, study_tables.headline(runs))
    if not targets.empty:
        print("\ntargets, first repetition (read >= 0.95x ceiling, disk busy >= 90 %, TTFT p50 "
              "<= 1.2x floor):")
        print(targets.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        print("\n".join(study_targets.target_reasons(runs, targets)))


def _each(reps: list[dict[str, Path]], profile: str, missing: str) -> str:
    """A profile's run of every repetition, in block order: the gates pair them by position."""
    return " ".join(str(runs[profile]) for runs in reps if profile in runs) or missing


def run(args: argparse.Namespace) -> int:
    from kvscope import estimate, study, study_options
    from kvscope.analysis import study_repeats, study_report
    from kvscope.contract.study_roles import BASELINE, CANDIDATE
    from kvscope.capture.device_twin import DeviceTwinError
    from kvscope.capture.workload import device
    from kvscope.capture.workload.kvdir import DEFAULT_ROOT
    from kvscope.capture.workload.server import ServerError
    from kvscope.capture.workload.system import HostError

    out = args.out or Path("runs") / f"demo-{dt.datetime.now():%Y%m%d-%H%M%S}"
    opts = study_options.StudyOptions(
        out=out, model=args.model, profiles=[p for p in args.profiles.split(",") if p],
        requests=args.requests, concurrency=args.concurrency, prompt_tokens=args.prompt_tokens,
        port=args.port, kv_dir_base=args.kv_dir_base, share_warm=args.share_warm,
        device=args.device, repeats=args.repeats, order=args.order, seed=args.seed,
        command=sys.argv)
    started = time.monotonic()
    try:
        device.check(opts.device)  # a bad --device, or a twin without root: before any work
        device.refuse_place(opts.device, opts.kv_dir_base, "--kv-dir-base")
        said = estimate.words(opts, estimate.fp32_gflops(), estimate.bf16_native(),
                              os.getloadavg()[0], os.cpu_count() or 1)
        print(f"kvscope demo: {said}", flush=True)
        with device.held(opts.device, DEFAULT_ROOT) as twin:
            where = Path(twin.mountpoint) if twin else opts.kv_dir_base or DEFAULT_ROOT
            read_from = device.describe(device.section_for(twin, where), where)
            print(f"kvscope demo: device: {read_from}", flush=True)
            reps = study.run_study(opts, twin)
    except (ValueError, HostError, ServerError, FileExistsError, DeviceTwinError) as e:
        print(f"kvscope demo: error: {e}", file=sys.stderr)
        return 2
    runs = reps[0]
    table, summary = study_repeats.pooled_headline(reps), study_repeats.replicated(reps)
    report = study_report.write_report(out, reps, table, summary,
                                       {p: study.warm_group(p) for p in runs})
    _print_findings(reps, table, summary)
    print(f"\ndevice:    {read_from}, {_ceiling_words(runs)}")
    print(f"report:    {report}")
    print(f"dashboard: .venv/bin/kvscope dashboard {' '.join(map(str, runs.values()))}")
    print("jaeger:    .venv/bin/kvscope export otlp RUN, then Jaeger UI > Search > Upload JSON; "
          "or set OTEL_EXPORTER_OTLP_ENDPOINT=http://<jaeger>:4317 before the run (docs/tracing.md)")
    print(f"gates:     .venv/bin/kvscope check {_each(reps, CANDIDATE, 'RUN')} --against "
          f"{_each(reps, BASELINE, 'BASELINE_RUN')} --gates analysis/gates/seeds-g3.json")
    print(f"took:      {(time.monotonic() - started) / 60:.1f} min")
    return 0
