# SPDX-License-Identifier: Apache-2.0
"""The disk's read rate with the CPUs idle and with them busy, side by side (root).

Why: the study judges reads against a ceiling measured while the machine is otherwise idle, but a
serving engine keeps its cores busy while it reads. On a VM whose virtual disk is emulated by host
threads that share host cores with the vCPUs (Firecracker here), busy vCPUs slow the disk itself,
whatever the guest schedules: the spinners run at nice 19, so the readers get a core whenever they
want one, and a spinner touches no memory, so memory bandwidth is not what they take. The ratio
printed is how much of the idle ceiling a read path can reach while the engine computes
(docs/backend.md, "Where the read phase's time goes").

The reader is the ceiling's own (`capture.ceiling.read_files`: raw O_DIRECT preadv into huge pages,
no checks), on the run's chunk files, page cache dropped before each measurement; the conditions
alternate in every repetition.

examples:
  sudo .venv/bin/python bench/ceiling_under_load.py --kv-dir /var/tmp/kvscope/kv
  sudo .venv/bin/python bench/ceiling_under_load.py --kv-dir DIR --reps 5 --unit 64MiB --depth 8
"""

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Optional


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("examples:")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-dir", type=Path, required=True, help="directory of chunk files")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--limit", default="2GiB", help="bytes of chunk files read per measurement")
    parser.add_argument("--unit", default="4MiB")
    parser.add_argument("--depth", type=int, default=32)
    return parser.parse_args(argv)


def _read(files: list[Path], unit: int, depth: int, busy: int) -> float:
    """GB/s of one read of `files` while `busy` spinners (nice 19) keep that many CPUs busy."""
    from kvscope.capture import ceiling
    from kvscope.capture.workload import system

    with ceiling.cpus_busy(busy):
        system.drop_page_cache()
        return ceiling.read_files(files, unit, depth).bytes_per_s / 1e9


def main(argv: Optional[list[str]] = None) -> int:
    """Print every measurement, the medians and their ratios to idle; 2 on bad input."""
    args = _parse(argv)
    from kvscope.capture import ceiling
    from kvscope.patched_backend.parallel_disk.config import parse_size

    try:
        limit, unit = parse_size("--limit", args.limit), parse_size("--unit", args.unit)
    except ValueError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return 2
    files = ceiling.chunk_files(args.kv_dir, limit)
    if not files:
        print(f"ERROR: no chunk files under {args.kv_dir}; run a warm phase with --keep-kv first",
              file=sys.stderr)
        return 2
    cpus = len(os.sched_getaffinity(0))
    levels = sorted({0, 1, cpus})
    rates: dict[int, list[float]] = {n: [] for n in levels}
    print(f"{len(files)} files, {args.unit} x {args.depth}; load average before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for rep in range(args.reps):
        for busy in levels:
            rates[busy].append(_read(files, unit, args.depth, busy))
            print(f"rep {rep}: {busy} of {cpus} CPUs busy: {rates[busy][-1]:.2f} GB/s", flush=True)
    idle = statistics.median(rates[0])
    for busy in levels:
        median = statistics.median(rates[busy])
        print(f"{busy} of {cpus} CPUs busy: median {median:.2f} GB/s, {median / idle:.2f}x idle "
              f"({', '.join(f'{r:.2f}' for r in rates[busy])})")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
