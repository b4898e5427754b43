# SPDX-License-Identifier: Apache-2.0
"""What the block probe costs at the disk's highest IOPS, measured side by side in one run.

fio does small random O_DIRECT reads at a deep queue on a file on the root disk, alternately
without and with the block probe (pid filter on fio, device filter on its disk). For each probed
run it reports events/s, lost events, and the probe's CPU time as a share of one core: the
kernel time of its BPF programs (kernel.bpf_stats_enabled run_time_ns) plus the user+system CPU
of this process's ring-buffer thread while fio runs; decoding at stop is reported on its own.

    sudo .venv/bin/python bench/probe_overhead.py [--runtime 8] [--rounds 2] [--depth 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from probes.block import BlockProbe, disk_holding
from probes.block_bpf import BlockOptions
from probes.fio import FioReads

BPF_STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


def _prog_run_ns(ids: list[int]) -> int:
    progs = json.loads(subprocess.check_output(["bpftool", "prog", "show", "-j"]))
    return sum(p.get("run_time_ns", 0) for p in progs if p["id"] in ids)


def run_plain(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    fio = FioReads(path, size=args.size, depth=args.depth, runtime_s=args.runtime,
                   pattern="randread")
    return {"iops": fio.report()["iops"]}


def run_probed(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    fio = FioReads(path, size=args.size, depth=args.depth, runtime_s=args.runtime,
                   pattern="randread")
    probe = BlockProbe(BlockOptions(), pids=[fio.pid], devices=[disk_holding(path)]).start()
    ids = probe.program_ids()
    cpu0, wall0, bpf0 = time.process_time_ns(), time.monotonic_ns(), _prog_run_ns(ids)
    iops = fio.report()["iops"]
    bpf_ns = _prog_run_ns(ids) - bpf0
    cpu_ns, wall_ns = time.process_time_ns() - cpu0, time.monotonic_ns() - wall0
    probe.stop()
    t0 = time.process_time_ns()
    result = probe.result("bench")
    decode_s = (time.process_time_ns() - t0) / 1e9
    events = len(result.block_io)
    return {
        "iops": iops, "events": events, "events_per_s": events / (wall_ns / 1e9),
        "lost": sum(result.lost_events.values()),
        "bpf_share": bpf_ns / wall_ns, "user_share": cpu_ns / wall_ns,
        "probe_share": (bpf_ns + cpu_ns) / wall_ns, "decode_s": decode_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", type=float, default=8.0, help="seconds per fio run")
    parser.add_argument("--rounds", type=int, default=2, help="plain/probed pairs")
    parser.add_argument("--depth", type=int, default=32, help="fio iodepth")
    parser.add_argument("--size", type=int, default=4096, help="bytes per read")
    parser.add_argument("--file", type=Path, default=Path("/var/tmp/kvscope-bench.dat"))
    args = parser.parse_args(argv)
    if not args.file.exists():
        subprocess.run(["fio", "--name=make", f"--filename={args.file}", "--size=1g",
                        "--rw=write", "--bs=1m", "--direct=1", "--output=/dev/null"], check=True)
    stats_before = BPF_STATS.read_text().strip()
    BPF_STATS.write_text("1")
    try:
        rows = []
        for _ in range(args.rounds):
            rows.append(("plain", run_plain(args.file, args)))
            rows.append(("probed", run_probed(args.file, args)))
    finally:
        BPF_STATS.write_text(stats_before)
    report(rows, args)
    return 0


def report(rows: list[tuple[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    print(f"fio randread {args.size} B, iodepth {args.depth}, {args.runtime:g} s per run, "
          f"{os.cpu_count()} CPUs, file {args.file}")
    print(f"{'run':<7} {'IOPS':>9} {'events/s':>9} {'lost':>5} {'bpf %':>6} {'user %':>7} "
          f"{'probe %core':>11} {'decode s':>8}")
    for name, r in rows:
        if name == "plain":
            print(f"{name:<7} {r['iops']:>9.0f}")
        else:
            print(f"{name:<7} {r['iops']:>9.0f} {r['events_per_s']:>9.0f} {r['lost']:>5} "
                  f"{100 * r['bpf_share']:>6.2f} {100 * r['user_share']:>7.2f} "
                  f"{100 * r['probe_share']:>11.2f} {r['decode_s']:>8.3f}")
    plain = statistics.mean(r["iops"] for n, r in rows if n == "plain")
    probed = statistics.mean(r["iops"] for n, r in rows if n == "probed")
    share = statistics.mean(r["probe_share"] for n, r in rows if n == "probed")
    print(f"IOPS with / without probe: {probed / plain:.3f}; probe CPU {100 * share:.2f} % of one "
          f"core (target <= 5 %)")


if __name__ == "__main__":
    sys.exit(main())
