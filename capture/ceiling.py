"""The device ceiling: how fast this disk reads the run's own chunk files with nothing in the way.

A ceiling is the best of several measurements, not one: a small sweep of depth and request size
with a raw reader (O_DIRECT, `depth` threads each keeping one `unit`-byte preadv in flight, no
LMCache, no checksums) and with fio where it is installed, page cache dropped before each. One
measurement on a shared machine can land in a slow moment; the best of several is the least
under-measured, and the spread (kept beside it) says how much the machine drifted. A study
merges every run's measurements per device (`contract.ceiling.best_of`) so all its runs share
one ceiling.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from kvscope.capture.workload import system
from kvscope.contract.ceiling import Ceiling, best_of
from kvscope.patched_backend.parallel_disk import rawread

DEFAULT_UNIT = 4 << 20
DEFAULT_DEPTH = 32
# (unit, depth) of the raw reader's sweep; the first is the historical single measurement.
SWEEP: tuple[tuple[int, int], ...] = ((4 << 20, 32), (4 << 20, 8), (1 << 20, 16), (16 << 20, 8))
SWEEP_LIMIT_BYTES = 2 << 30  # bytes read per sweep point: ~0.5 s at 4 GB/s
BUSY_REPS = 3  # idle and busy reads alternated this many times: the medians are compared
SPIN_SETTLE_S = 1.0  # for the spinners to reach their cores before a busy read
FIO_METHOD = "fio io_uring O_DIRECT sequential read, page cache dropped"


def read_files(files: list[Path], unit: int = DEFAULT_UNIT, depth: int = DEFAULT_DEPTH,
               when: str = "") -> Ceiling:
    """Read every file once with the raw reader (`rawread.read_files`): its rate as a ceiling.

    Raises:
        OSError: a file is a link (ELOOP) or no regular file (`rawread.open_direct`), or
            unreadable.
    """
    total, seconds = rawread.read_files(files, unit, depth)
    return Ceiling(total / seconds if seconds else 0.0, total, seconds, len(files), unit, depth,
                   when=when)


@contextmanager
def cpus_busy(n: int) -> Iterator[None]:
    """`n` spinning processes at nice 19 for the body's duration: the CPUs are busy, as a
    serving engine keeps them, yet any reader that wants a core gets it at once, and a spinner
    touches no memory. On a VM whose virtual disk is emulated by host threads sharing host cores
    with the vCPUs, busy vCPUs slow the disk itself; this is how to see it."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        for proc in spinners:  # not preexec_fn: unsafe in a process with threads
            os.setpriority(os.PRIO_PROCESS, proc.pid, 19)
        if spinners:
            time.sleep(SPIN_SETTLE_S)
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def measure_busy(kv_dir: Path, unit: int, depth: int, reps: int = BUSY_REPS,
                 limit_bytes: int = SWEEP_LIMIT_BYTES) -> dict[str, Any] | None:
    """The disk's rate with every CPU busy over its rate idle, the two read alternately `reps`
    times at one configuration (None when there are no chunk files); needs root.

    A live phase reads while the engine computes, so the idle ceiling can be out of reach for
    reasons no read path controls; this ratio says how far (the study scales its ceiling by it
    for a second bar)."""
    files = chunk_files(kv_dir, limit_bytes)
    if not files:
        return None
    cpus = len(os.sched_getaffinity(0))
    idle: list[float] = []
    busy: list[float] = []
    for _ in range(reps):
        system.drop_page_cache()
        idle.append(read_files(files, unit, depth).bytes_per_s)
        with cpus_busy(cpus):
            system.drop_page_cache()
            busy.append(read_files(files, unit, depth).bytes_per_s)
    idle_rate, busy_rate = statistics.median(idle), statistics.median(busy)
    return {"unit": unit, "depth": depth, "busy_cpus": cpus, "idle_bytes_per_s": idle_rate,
            "busy_bytes_per_s": busy_rate, "ratio": busy_rate / idle_rate if idle_rate else 0.0,
            "idle_samples": idle, "busy_samples": busy}


def fio_read(files: list[Path], unit: int = DEFAULT_UNIT, depth: int = DEFAULT_DEPTH,
             when: str = "", fio: str = "fio") -> Ceiling:
    """The same files read once by fio (io_uring, O_DIRECT, `depth` in flight, `unit` blocks).

    Raises:
        RuntimeError: fio failed; the message carries its error output.
    """
    names = ":".join(str(p).replace(":", "\\:") for p in files)
    argv = [fio, "--name=ceiling", "--readonly", "--direct=1", "--rw=read", f"--bs={unit}",
            f"--iodepth={depth}", "--ioengine=io_uring", f"--filename={names}",
            "--file_service_type=roundrobin", "--output-format=json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    read = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]["read"]
    total, seconds = int(read["io_bytes"]), read["runtime"] / 1e3
    return Ceiling(total / seconds if seconds else 0.0, total, seconds, len(files), unit, depth,
                   method=FIO_METHOD, when=when)


def chunk_files(kv_dir: Path, limit_bytes: int) -> list[Path]:
    """The largest 4 KiB-aligned files under kv_dir, up to limit_bytes in all."""
    files = sorted((p for p in Path(kv_dir).rglob("*") if p.is_file() and not p.is_symlink()),
                   key=lambda p: p.stat().st_size, reverse=True)
    chosen, total = [], 0
    for path in files:
        st = path.stat()
        size = st.st_size
        # a sparse file (a raw-block image) reads its holes as zeros without the disk
        if size == 0 or size % 4096 or st.st_blocks * 512 < size or total >= limit_bytes:
            continue
        chosen.append(path)
        total += size
    return chosen


def measure(kv_dir: Path, limit_bytes: int = SWEEP_LIMIT_BYTES, when: str = "before the first "
            "cold phase", sweep: tuple[tuple[int, int], ...] = SWEEP,
            fio: str | None = None) -> Ceiling | None:
    """The best of a sweep over the run's chunk files (None when there are none); needs root.

    `fio`: the fio binary (default: the one on PATH, if any); a failing fio is skipped, the raw
    reader's sweep still stands.
    """
    files = chunk_files(kv_dir, limit_bytes)
    if not files:
        return None
    taken = []
    for unit, depth in sweep:
        system.drop_page_cache()
        taken.append(read_files(files, unit, depth, when))
    fio = fio or shutil.which("fio")
    if fio:
        system.drop_page_cache()
        try:
            taken.append(fio_read(files, sweep[0][0], sweep[0][1], when, fio))
        except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired):
            pass  # the raw sweep is the ceiling then; fio is an extra witness, not a need
    return best_of(taken)
