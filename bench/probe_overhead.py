# SPDX-License-Identifier: Apache-2.0
"""What the block probes cost, per mode, at the disk's highest 4 KiB IOPS and at the KV
workload's own I/O size, measured side by side in one run.

fio does O_DIRECT random reads on a file on the root disk (4 KiB at iodepth 32, the disk's
highest IOPS; 4 MiB at iodepth 4, the KV chunk reads), alternately without a probe and with
each probe configuration:

    per-io           the per-I/O probe on fio's disk, no pid filter (rows for every request):
                     tp_btf programs, request state in array slots (probes/block_bpf.py)
    per-io:raw_tp    the same program as raw tracepoints reading fields through probe-read
                     helpers (what kernels without BTF-typed tracepoints get)
    per-io:before    the per-I/O probe of git revision --before (default: the last one before
                     the slots and tp_btf, five raw tracepoints and a hash table per request),
                     run from that revision's tree in a child process
    per-io+pid       the per-I/O probe, pid filter on fio
    aggregate        the aggregate probe (kernel histograms only, no tracked ids)
    aggregate+idle   the aggregate probe tracking an idle process (the server between reads:
                     the id check runs on every request, no rows)
    aggregate+pid    the aggregate probe tracking fio (a row for every request: its worst case)

Aggregate runs also sample /sys/block/<disk>/inflight every second, as a probe session does.
For each probed run: completions seen per second on fio's disk, events lost, BPF ns per I/O seen
and per program run (the programs also run, and cost, for other disks' I/O before filtering),
and the probe's CPU as a share of one core: the kernel time of its BPF programs (kernel.bpf_stats_enabled run_time_ns; `net`
subtracts what bpf_stats itself adds per run, measured on an empty program) plus the CPU of
this process (ring-buffer thread, sampler) while fio runs; and fio's IOPS over the plain run
just before it. The machine is shared: the 1-minute load average is printed with every run.

    sudo .venv/bin/python bench/probe_overhead.py [--runtime 5] [--rounds 2] [--sizes 4k,4m]
        [--configs per-io,per-io:before,...] [--before REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvscope.probes.aggregate import AggregateProbe
from kvscope.probes.block import BlockProbe, BlockResult, disk_holding
from kvscope.probes.block_bpf import BlockOptions
from kvscope.probes.fio import FioReads
from kvscope.probes.sampler import InflightSampler
from kvscope.probes.session import AGGREGATE_DEPTH_INTERVAL_S

BPF_STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
WORKLOADS = {"4k": (4096, 32), "4m": (4 << 20, 4)}  # bytes per read, iodepth
CONFIGS = ("per-io", "per-io:raw_tp", "per-io:before", "per-io+pid", "aggregate",
           "aggregate+idle", "aggregate+pid")
TARGET = 1.0  # % of one core, the aggregate mode's budget (issue 13)
PER_IO_TARGET_NS = 500  # BPF ns per I/O of the per-I/O mode at the top 4 KiB IOPS (issue 24)
BEFORE = "7ec44ce"  # the per-I/O probe before slots and tp_btf
# The child that runs another revision's per-I/O probe: prints its program ids once attached,
# detaches on a line from stdin, then prints its rows and lost events.
BEFORE_CHILD = """
import json, sys
from kvscope.probes.block import BlockProbe
from kvscope.probes.block_bpf import BlockOptions
probe = BlockProbe(BlockOptions(), devices=[sys.argv[1]]).start()
print(json.dumps(probe.program_ids()), flush=True)
sys.stdin.readline()
probe.stop()
result = probe.result("bench")
print(json.dumps({"rows": len(result.block_io), "lost": result.lost_events}), flush=True)
"""


@dataclass
class Probed:
    """A probe attached for one fio run, and what stops it and gives its counts."""

    ids: list[int]
    stop: Callable[[], tuple[int, int, dict[str, int]]]  # -> completions seen, rows, lost
    result: BlockResult | None = None  # the per-I/O probe's, once stopped


@dataclass
class Window:
    """The disk's completed reads (/sys/block/<disk>/stat) read before and after the fio run,
    each read bracketed by monotonic ns: the kernel's own count to hold the rows against."""

    disk: str
    reads: list[int] = field(default_factory=list)
    stamps: list[tuple[int, int]] = field(default_factory=list)

    def mark(self) -> None:
        before = time.monotonic_ns()
        self.reads.append(int((Path("/sys/block") / self.disk / "stat").read_text().split()[0]))
        self.stamps.append((before, time.monotonic_ns()))

    def exactness(self, result: BlockResult) -> tuple[int, int, int, int]:
        """(kernel reads, rows + complete_missed for reads surely inside the window, the same
        for reads that may be inside: the edges' slack, reads completing as stat was read)."""
        rows = result.block_io
        done = rows.loc[(rows["op"] == "R") & (rows["device"] == self.disk), "complete_ns"]
        (a0, a1), (b0, b1) = self.stamps
        missed = result.lost_by_op["complete_missed"]["R"]
        return (self.reads[1] - self.reads[0], int(done.between(a1, b0).sum()) + missed,
                int(done.between(a0, b1).sum()) + missed, missed)


def _prog_stats(ids: list[int]) -> dict[str, tuple[int, int]]:
    """(run_time_ns, run_cnt) of each program in `ids`, by name (as bpftool shortens it)."""
    progs = json.loads(subprocess.check_output(["bpftool", "prog", "show", "-j"]))
    return {p.get("name", str(p["id"])): (p.get("run_time_ns", 0), p.get("run_cnt", 0))
            for p in progs if p["id"] in ids}


def _totals(stats: dict[str, tuple[int, int]]) -> tuple[int, int]:
    return sum(ns for ns, _ in stats.values()), sum(n for _, n in stats.values())


def attach(config: str, fio_pid: int, idle_pid: int, device: str, before: Path) -> Probed:
    if config == "per-io:before":
        return _attach_before(before, device)
    if config.startswith("per-io"):
        pids = [fio_pid] if config == "per-io+pid" else None
        attach_kind = "raw_tp" if config == "per-io:raw_tp" else "tp_btf"
        probe = BlockProbe(BlockOptions(attach=attach_kind), pids=pids, devices=[device]).start()

        def stop_per_io() -> tuple[int, int, dict[str, int]]:
            probe.stop()
            probed.result = probe.result("bench")
            rows = len(probed.result.block_io)
            return rows, rows, probed.result.lost_events

        probed = Probed(probe.program_ids(), stop_per_io)
        return probed
    track = {"aggregate": None, "aggregate+idle": [idle_pid], "aggregate+pid": [fio_pid]}[config]
    agg = AggregateProbe(track=track, devices=[device]).start()
    sampler = InflightSampler([device], interval_s=AGGREGATE_DEPTH_INTERVAL_S)

    def stop_aggregate() -> tuple[int, int, dict[str, int]]:
        agg.stop()
        sampler.stop("bench")
        result = agg.result("bench")
        seen = int(result.totals[result.totals["pid"] == -1]["ios"].sum())
        return seen, len(result.block_io), result.lost_events

    return Probed(agg.program_ids(), stop_aggregate)


def _attach_before(tree: Path, device: str) -> Probed:
    """The per-I/O probe of an extracted revision, attached in a child process."""
    # cwd too: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH
    child = subprocess.Popen([sys.executable, "-c", BEFORE_CHILD, device], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=tree,
                             env={**os.environ, "PYTHONPATH": str(tree)})
    assert child.stdin is not None and child.stdout is not None
    ids = json.loads(child.stdout.readline() or "null")
    if ids is None:
        child.wait()
        raise RuntimeError(f"the per-I/O probe of {tree} did not start (exit {child.returncode})")

    def stop_before() -> tuple[int, int, dict[str, int]]:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("stop\n")
        child.stdin.flush()
        out = json.loads(child.stdout.readline())
        child.wait()
        return out["rows"], out["rows"], out["lost"]

    return Probed(ids, stop_before)


def extract_revision(rev: str, into: Path) -> Path:
    """The tree of git revision `rev` of this checkout, unpacked under `into`."""
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(root), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def empty_program_ns(path: Path, args: argparse.Namespace) -> float:
    """What bpf_stats adds to one run: run_time_ns per run of an empty program on
    block_rq_complete, under the 4 KiB load."""
    from bcc import BPF

    bpf = BPF(text=b"RAW_TRACEPOINT_PROBE(block_rq_complete) { return 0; }")
    try:
        fio = FioReads(path, size=4096, depth=32, runtime_s=min(args.runtime, 3),
                       pattern="randread")
        ids = [int(line.split()[1]) for fn in bpf.funcs.values() for line in
               Path(f"/proc/self/fdinfo/{fn.fd}").read_text().splitlines()
               if line.startswith("prog_id:")]
        ns0, n0 = _totals(_prog_stats(ids))
        fio.report()
        ns1, n1 = _totals(_prog_stats(ids))
    finally:
        bpf.cleanup()
    return (ns1 - ns0) / max(n1 - n0, 1)


def run_once(path: Path, size: int, depth: int, config: str | None, args: argparse.Namespace,
             empty_ns: float, before: Path) -> dict[str, Any]:
    fio = FioReads(path, size=size, depth=depth, runtime_s=args.runtime, pattern="randread")
    load = os.getloadavg()[0]
    if config is None:
        return {"iops": fio.report()["iops"], "load": load}
    idle = subprocess.Popen(["sleep", str(args.runtime + 30)])
    try:
        probed = attach(config, fio.pid, idle.pid, disk_holding(path), before)
        window = Window(disk_holding(path))
        cpu0, wall0 = time.process_time_ns(), time.monotonic_ns()
        stats0 = _prog_stats(probed.ids)
        window.mark()
        iops = fio.report()["iops"]
        window.mark()
        stats1 = _prog_stats(probed.ids)
        cpu_ns, wall_ns = time.process_time_ns() - cpu0, time.monotonic_ns() - wall0
        seen, rows, lost = probed.stop()
    finally:
        idle.kill()
        idle.wait()
    (bpf0, runs0), (bpf1, runs1) = _totals(stats0), _totals(stats1)
    bpf_ns, runs = bpf1 - bpf0, runs1 - runs0
    programs = {name: (ns - stats0[name][0], n - stats0[name][1])
                for name, (ns, n) in stats1.items() if name in stats0}
    exact = window.exactness(probed.result) if probed.result is not None else None
    return {
        "exact": exact,
        "iops": iops, "load": load, "seen_per_s": seen / (wall_ns / 1e9), "rows": rows,
        "lost": sum(max(v, 0) for k, v in lost.items() if k != "complete_nested"),
        "bpf_ns_per_io": bpf_ns / max(seen, 1), "bpf_ns_per_run": bpf_ns / max(runs, 1),
        "runs_per_io": runs / max(seen, 1),
        "programs": {name: (ns / max(n, 1), n / max(seen, 1)) for name, (ns, n) in programs.items()},
        "bpf_share": bpf_ns / wall_ns,
        "net_share": max(bpf_ns - runs * empty_ns, 0) / wall_ns + cpu_ns / wall_ns,
        "user_share": cpu_ns / wall_ns, "probe_share": (bpf_ns + cpu_ns) / wall_ns,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", type=float, default=5.0, help="seconds per fio run")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the configurations")
    parser.add_argument("--sizes", default="4k,4m", help="workloads: 4k (iodepth 32), 4m (4)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="probe configurations")
    parser.add_argument("--file", type=Path, default=Path("/var/tmp/kvscope-bench.dat"))
    parser.add_argument("--before", default=BEFORE, help="git revision whose per-I/O probe "
                        f"per-io:before runs (default {BEFORE})")
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    with tempfile.TemporaryDirectory(prefix="kvscope-before-") as tmp:
        before = extract_revision(args.before, Path(tmp)) if "per-io:before" in configs \
            else Path(tmp)
        return measure(args, configs, before)


def measure(args: argparse.Namespace, configs: list[str], before: Path) -> int:
    if not args.file.exists():
        subprocess.run(["fio", "--name=make", f"--filename={args.file}", "--size=1g",
                        "--rw=write", "--bs=1m", "--direct=1", "--output=/dev/null"], check=True)
    bpf_stats_was = BPF_STATS.read_text().strip()
    BPF_STATS.write_text("1")
    rows: list[tuple[str, str, dict[str, Any]]] = []
    try:
        empty_ns = empty_program_ns(args.file, args)
        for _ in range(args.rounds):
            for name in args.sizes.split(","):
                size, depth = WORKLOADS[name]
                for config in configs:  # a plain run before each probed one: pairs
                    rows.append((name, "plain",
                                 run_once(args.file, size, depth, None, args, 0, before)))
                    rows.append((name, config,
                                 run_once(args.file, size, depth, config, args, empty_ns, before)))
    finally:
        BPF_STATS.write_text(bpf_stats_was)
    report(rows, args, empty_ns)
    return 0


def report(rows: list[tuple[str, str, dict[str, Any]]], args: argparse.Namespace,
           empty_ns: float) -> None:
    print(f"fio randread O_DIRECT, {args.runtime:g} s per run, {os.cpu_count()} CPUs, file "
          f"{args.file}; bpf_stats adds {empty_ns:.0f} ns per program run (empty program)")
    print(f"{'io':<3} {'run':<15} {'load':>5} {'IOPS':>8} {'ratio':>6} {'seen/s':>8} {'rows':>7} "
          f"{'lost':>4} {'ns/io':>6} {'ns/run':>6} {'bpf %':>6} {'user %':>6} {'probe %':>7} "
          f"{'net %':>6}")
    plain: dict[str, Any] = {}
    for name, config, r in rows:
        if config == "plain":
            plain = r
            print(f"{name:<3} {config:<15} {r['load']:>5.1f} {r['iops']:>8.0f}")
            continue
        print(f"{name:<3} {config:<15} {r['load']:>5.1f} {r['iops']:>8.0f} "
              f"{r['iops'] / plain['iops']:>6.3f} {r['seen_per_s']:>8.0f} {r['rows']:>7} "
              f"{r['lost']:>4} {r['bpf_ns_per_io']:>6.0f} {r['bpf_ns_per_run']:>6.0f} "
              f"{100 * r['bpf_share']:>6.2f} "
              f"{100 * r['user_share']:>6.2f} {100 * r['probe_share']:>7.2f} "
              f"{100 * r['net_share']:>6.2f}")
        r["ratio"] = r["iops"] / plain["iops"]
    print("\nper workload and configuration, mean over rounds:")
    for name in dict.fromkeys(n for n, _, _ in rows):
        for config in dict.fromkeys(c for n, c, _ in rows if n == name and c != "plain"):
            got = [r for n, c, r in rows if n == name and c == config]
            mean = {k: statistics.mean(r[k] for r in got)
                    for k in ("ratio", "probe_share", "net_share", "seen_per_s")}
            median = statistics.median(r["ratio"] for r in got)
            print(f"{name:<3} {config:<15} IOPS ratio {mean['ratio']:.3f} (median of "
                  f"{len(got)} pairs {median:.3f}), probe CPU "
                  f"{100 * mean['probe_share']:.2f} % of one core ({100 * mean['net_share']:.2f} "
                  f"% without bpf_stats' own cost) at {mean['seen_per_s']:.0f} I/Os per s, lost "
                  f"{sum(r['lost'] for r in got)}")
    print(f"(aggregate target: <= {TARGET:g} % of one core, IOPS ratio >= 0.98)")
    print("\nkernel-counted reads of the disk (/sys/block/<disk>/stat) against block_io read "
          "rows + complete_missed, per-I/O runs (edges: reads completing while stat was read):")
    for name, config, r in rows:
        if r.get("exact") is not None:
            kernel, inner, outer, missed = r["exact"]
            verdict = "exact" if inner <= kernel <= outer else "MISMATCH"
            print(f"{name:<3} {config:<15} kernel {kernel:>8} rows+missed {inner:>8}..{outer:<8}"
                  f" (missed {missed}) {verdict}")
    per_io = {c: statistics.mean(r["bpf_ns_per_io"] for n, cc, r in rows if n == "4k" and cc == c)
              for c in ("per-io", "per-io:raw_tp", "per-io:before")
              if any(n == "4k" and cc == c for n, cc, _ in rows)}
    if "per-io" in per_io:
        net = per_io["per-io"] - empty_ns * statistics.mean(
            r["runs_per_io"] for n, c, r in rows if n == "4k" and c == "per-io")
        print(f"per-I/O mode at 4 KiB: {per_io['per-io']:.0f} BPF ns per I/O "
              f"({net:.0f} without what bpf_stats adds), target <= {PER_IO_TARGET_NS}"
              + "".join(f"; {c} {ns:.0f} ns ({ns / per_io['per-io']:.2f}x)"
                        for c, ns in per_io.items() if c != "per-io"))
    print("BPF ns per run (runs per I/O) of each program at 4 KiB, mean over rounds:")
    for config in per_io:
        got = [r["programs"] for n, c, r in rows if n == "4k" and c == config]
        print(f"    {config:<15}" + "".join(
            f" {name} {statistics.mean(p[name][0] for p in got):.0f} "
            f"({statistics.mean(p[name][1] for p in got):.2f})"
            for name in sorted(got[0]) if all(name in p for p in got)))


if __name__ == "__main__":
    sys.exit(main())
