"""`kvscope demo`: the serial-vs-parallel study on the live stack, end to end, with its report."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path

EXAMPLES = """examples:
  kvscope demo                                   # prints its estimate first (a short calibration)
  kvscope demo --requests 4 --concurrency 1,4    # a quick look
  kvscope demo --requests 32 --concurrency 8,16,32 --prompt-tokens 8192   # a bigger host
"""
HEADLINE_COLUMNS = ["profile", "conc", "ttft_p50_s", "ttft_p99_s", "storage_read_p50_s",
                    "transfer_p50_s", "prefill_p50_s", "read_GBps", "ceiling_GBps",
                    "req_per_s", "storage_tok_per_s", "speedup_vs_serial", "throughput_vs_serial",
                    "bound"]


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvscope.capture.workload import device
    from kvscope.commands.run import _levels
    from kvscope.study_options import StudyOptions

    d = StudyOptions(out=Path("."))
    p = subparsers.add_parser(
        "demo", help="run the KV read study on the live stack: kvscope serial and parallel, LMCache's "
        "stock disk tier and its other disk paths that run here",
        description="For each backend profile: a warm phase and cold phases at each concurrency "
        "level with tracing and probes on; then analysis, comparison and the study report.",
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
    p.set_defaults(func=run)


def _ceiling_words(runs: dict[str, Path]) -> str:
    """The study's measured ceiling on the device its runs read (one device per study)."""
    from kvscope.contract import rundir

    measured = rundir.read_manifest(next(iter(runs.values()))).get("study", {}).get(
        "device_ceiling")
    if not measured:
        return "its ceiling could not be measured"
    return (f"ceiling {measured['bytes_per_s'] / 1e9:.2f} GB/s ({measured['unit'] >> 10} KiB "
            f"reads, {measured['depth']} in flight)")


def run(args: argparse.Namespace) -> int:
    from kvscope import estimate, study, study_options
    from kvscope.analysis import (study_peers, study_report, study_tables, study_targets,
                                  study_verdict)
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
        device=args.device, command=sys.argv)
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
            runs = study.run_study(opts, twin)
    except (ValueError, HostError, ServerError, FileExistsError, DeviceTwinError) as e:
        print(f"kvscope demo: error: {e}", file=sys.stderr)
        return 2
    table = study_tables.headline(runs)
    report = study_report.write_report(out, runs, table, {p: study.warm_group(p) for p in runs})
    print("\n" + table[HEADLINE_COLUMNS].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print("\n" + "\n".join(study_verdict.verdict(table, runs)))
    if peers := study_peers.peer_verdicts(table, study_peers.peer_comparisons(runs)):
        print("\nkvscope against the other disk paths:\n" + "\n".join(peers))
    targets = study_targets.target_rows(runs, table)
    if not targets.empty:
        print("\ntargets (read >= 0.95x ceiling, disk busy >= 90 %, TTFT p50 <= 1.2x floor):")
        print(targets.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        print("\n".join(study_targets.target_reasons(runs, targets)))
    print(f"\ndevice:    {read_from}, {_ceiling_words(runs)}")
    print(f"report:    {report}")
    print(f"dashboard: .venv/bin/kvscope dashboard {' '.join(map(str, runs.values()))}")
    print("jaeger:    .venv/bin/kvscope export otlp RUN, then Jaeger UI > Search > Upload JSON; "
          "or set OTEL_EXPORTER_OTLP_ENDPOINT=http://<jaeger>:4317 before the run (docs/tracing.md)")
    print(f"gates:     .venv/bin/kvscope check {runs.get(CANDIDATE, 'RUN')} --against "
          f"{runs.get(BASELINE, 'BASELINE_RUN')} --gates analysis/gates/seeds-g3.json")
    print(f"took:      {(time.monotonic() - started) / 60:.1f} min")
    return 0
