# SPDX-License-Identifier: Apache-2.0
"""fio as the probes' known workload (tests, bench): O_DIRECT reads at a fixed queue depth,
held in a shell until go() so a probe can attach with the pid known before the first read."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


class FioReads:
    """`count` reads (or `runtime_s` seconds of them) of `size` bytes, `depth` at a time.

    pattern "read" skips one block after each read (rw=read:SIZE) so the I/O scheduler cannot
    merge two into one request, and reaps each batch of `depth` before submitting the next;
    "randread" keeps `depth` in flight all the time (highest IOPS). fio runs its job as a
    thread (--thread), so every read is submitted under the pid returned here.
    """

    def __init__(self, path: Path, *, size: int, depth: int, count: int | None = None,
                 runtime_s: float | None = None, pattern: str = "read") -> None:
        if (count is None) == (runtime_s is None):
            raise ValueError("FioReads: give exactly one of count or runtime_s")
        opts = [f"--filename={path}", f"--bs={size}", f"--iodepth={depth}", "--direct=1",
                "--ioengine=libaio", "--thread", "--output-format=json", "--name=kvscope-probe"]
        if pattern == "read":
            opts += [f"--rw=read:{size}", f"--iodepth_batch_submit={depth}",
                     f"--iodepth_batch_complete_min={depth}"]
        elif pattern == "randread":
            opts += ["--rw=randread", "--norandommap", "--randrepeat=0"]
        else:
            raise ValueError(f"FioReads pattern {pattern!r}: expected 'read' or 'randread'")
        opts += [f"--number_ios={count}"] if count is not None else \
            ["--time_based", f"--runtime={runtime_s}s"]
        self.proc = subprocess.Popen(["sh", "-c", 'read go && exec fio "$@"', "fio", *opts],
                                     text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self.proc.pid

    def go(self) -> int:
        """Release the reads; returns how many completed."""
        return int(self.report()["total_ios"])

    def report(self) -> dict[str, Any]:
        """Release the reads and return fio's read statistics (total_ios, iops, ...)."""
        out, _ = self.proc.communicate("go\n", timeout=600)
        if self.proc.returncode != 0:
            raise RuntimeError(f"fio failed (exit {self.proc.returncode}): {out[-2000:]}")
        return json.loads(out)["jobs"][0]["read"]
