"""`kvscope probe --out RUN`: block / NVMe probes on their own, until --duration or Ctrl-C."""

from __future__ import annotations

import argparse
import getpass
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

EXAMPLES = """examples:
  kvscope probe --out runs/p1 --duration 10            # every disk for 10 s
  kvscope probe --out runs/p1 -p 4242 -d nvme0n1       # one process on one disk, until Ctrl-C
  kvscope probe --out runs/p1 --phase cold --pid 4242  # add a phase to an existing run
  kvscope probe --out runs/p1 --ebpf                   # print the BPF program and exit
  kvscope probe --out runs/p1 --mode aggregate -d vda --pids 4242,4250 --duration 3600
                         # always-on: kernel histograms of every I/O, rows for 4242 and 4250
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe", help="record block / NVMe requests with eBPF (or the sysfs fallback)",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, type=Path,
                        help="run directory: an existing run gets the phase added, a new "
                        "directory becomes a probe-only run")
    parser.add_argument("-p", "--pid", type=int, action="append", default=[],
                        help="per-io mode: keep only I/O submitted by this process (tgid); "
                        "aggregate mode: also write rows for I/O of this thread or process id; "
                        "repeatable")
    parser.add_argument("--pids", type=_id_list, default=[], metavar="ID,ID,...",
                        help="the same as -p for a comma-separated list")
    parser.add_argument("--mode", choices=("per-io", "aggregate"), default="per-io",
                        help="per-io (default): one block_io row per request, five tracepoints "
                        "per I/O; aggregate: latency histograms and counters per device and "
                        "process kept in the kernel (one tracepoint per I/O, a tenth of the "
                        "cost or less; bench/probe_overhead.py), rows only for --pid/--pids; "
                        "for long recordings on busy hosts")
    parser.add_argument("-d", "--device", action="append", default=[],
                        help="keep only this disk (vda, nvme0n1, loop0); repeatable")
    parser.add_argument("--duration", type=float, help="seconds to record (default: until "
                        "SIGINT/SIGTERM)")
    parser.add_argument("--phase", default="probe", help="phase name for the rows (default probe)")
    parser.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.ebpf:
        return _print_ebpf(args)
    from kvscope.contract import rundir
    from kvscope.probes import session

    pids = [*args.pid, *args.pids]
    probe_only = not (args.out / rundir.MANIFEST).exists()
    if probe_only:
        rundir.create(args.out, _probe_only_manifest(args))
    done = threading.Event()
    previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        probes = session.start(args.out, args.phase, pids=pids, devices=args.device,
                               mode=args.mode)
        mode = ("BPF, aggregate" if args.mode == "aggregate" else "BPF") if probes.plan \
            else "fallback sampler"
        print(f"kvscope probe: recording ({mode}) into {args.out}; Ctrl-C to stop", file=sys.stderr)
        done.wait(args.duration)
        probes.stop()
        if probe_only:
            rundir.update_manifest(args.out, "phases", [{
                "name": args.phase, "started_ns": probes.started_ns,
                "ended_ns": time.monotonic_ns()}])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    manifest = rundir.read_manifest(args.out)["probes"]
    rows = manifest["phases"][args.phase]["rows"]
    print(f"kvscope probe: mode {manifest['mode']}, rows {rows}, lost events "
          f"{manifest['lost_events']}")
    return 0


def _id_list(text: str) -> list[int]:
    """`4242,4250` -> [4242, 4250], with an error naming the bad item."""
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected thread / process ids separated "
                                         f"by commas, e.g. 4242,4250") from None


def _print_ebpf(args: argparse.Namespace) -> int:
    from kvscope.probes.block_bpf import BlockOptions, render
    from kvscope.probes.detect import Plan, detect

    if args.mode == "aggregate":
        from kvscope.probes import aggregate_bpf
        from kvscope.probes.btf import AGGREGATE_NEEDED, kernel_offsets

        print(aggregate_bpf.render(aggregate_bpf.AggregateOptions(
            track=bool(args.pid or args.pids), filter_devices=bool(args.device),
            offsets=kernel_offsets(AGGREGATE_NEEDED))))
        return 0
    plan = detect()
    opts = BlockOptions(key="dev_sector", filter_pids=bool(args.pid),
                        filter_devices=bool(args.device))
    if isinstance(plan, Plan):
        opts = BlockOptions(key=plan.key, attach=plan.attach,
                            start_tracepoint=plan.start_tracepoint,
                            filter_pids=opts.filter_pids, filter_devices=opts.filter_devices,
                            offsets=plan.offsets, flush_seq_bit=plan.flush_seq_bit)
    print(render(opts))
    return 0


def _probe_only_manifest(args: argparse.Namespace) -> dict[str, Any]:
    """The schema's required keys, filled with what a probe-only run knows (docs/probes.md)."""
    from kvscope.contract import host, manifest
    from kvscope.contract.clock import measure_offset

    return manifest.new(args.out, clock=measure_offset(),
                        machine=host.machine(",".join(args.device), user=getpass.getuser()),
                        server={}, workload={"phases": [args.phase], "probe_only": True})