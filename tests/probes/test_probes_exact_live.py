# SPDX-License-Identifier: Apache-2.0
"""Exact or counted (issue 24 item 4): every request the kernel accounts on a disk is a
block_io row of the per-I/O probe or one of its named lost events.

The kernel's own accounting is /sys/block/<disk>/stat, read before and after a window the probe
covers entirely. The disk is a loop device (mq-deadline, direct I/O to its backing file on the
root disk) with an ext4 file system that only this test touches, so it is idle at both reads and
the two counts cover exactly the same requests. In the window: fio 4 KiB random O_DIRECT reads
at depth 32 (the device's highest IOPS), and beside them on the same file system buffered writes
with fsync (flush sequences, journal writes, merges) and buffered sequential reads (read-ahead),
while other I/O runs on the root disk underneath.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from kvscope.probes.block import BlockProbe
from kvscope.probes.block_bpf import BlockOptions
from kvscope.probes.fio import FioReads

pytestmark = pytest.mark.root

STAT = {"R": 0, "W": 4, "D": 11, "F": 15}  # completed-request fields of /sys/block/<d>/stat


@pytest.fixture
def loop_fs(tmp_path: Path, scratch: Path) -> Iterator[tuple[str, Path]]:
    """(disk, mount point): ext4 on a 256 MiB loop device of its own under mq-deadline, with
    direct I/O to a backing file on the root disk; no lazy initialisation and no timed journal
    commit, so nothing writes to it on its own. Detached afterwards."""
    backing = scratch / f"exact-{os.getpid()}.bin"
    with open(backing, "wb") as f:
        f.truncate(256 << 20)
    dev = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(backing)],
                         check=True, capture_output=True, text=True).stdout.strip()
    disk = Path(dev).name
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        (Path("/sys/block") / disk / "queue" / "scheduler").write_text("mq-deadline")
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E",
                        "lazy_itable_init=0,lazy_journal_init=0", dev], check=True)
        subprocess.run(["mount", "-o", "noatime,commit=600", dev, str(mnt)], check=True)
        try:
            yield disk, mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)
        backing.unlink(missing_ok=True)


def _stat(disk: str) -> list[int]:
    return [int(v) for v in (Path("/sys/block") / disk / "stat").read_text().split()]


def _idle(disk: str) -> None:
    """Wait until nothing is in flight on `disk` (after a sync)."""
    subprocess.run(["sync", "-f", "/"], check=True)
    deadline = time.monotonic() + 30
    while any(int(v) for v in (Path("/sys/block") / disk / "inflight").read_text().split()):
        assert time.monotonic() < deadline, f"{disk} never went idle"
        time.sleep(0.01)


def _fio(*args: str) -> subprocess.Popen:
    return subprocess.Popen(["fio", "--output=/dev/null", *args])


@pytest.mark.timeout(180)
def test_kernel_accounted_requests_are_rows_or_counted_losses(
        loop_fs: tuple[str, Path], data_file: Path) -> None:
    disk, mnt = loop_fs
    reads = mnt / "reads.bin"
    subprocess.run(["fio", "--output=/dev/null", "--name=make", f"--filename={reads}",
                    "--size=64m", "--rw=write", "--bs=1m", "--direct=1"], check=True)
    with BlockProbe(BlockOptions(), devices=[disk]) as probe:
        _idle(disk)
        before, t0 = _stat(disk), time.monotonic_ns()
        others = [
            _fio("--name=sync-writes", f"--filename={mnt / 'writes.bin'}", "--size=32m",
                 "--rw=randwrite", "--bs=16k", "--fsync=4", "--time_based", "--runtime=4"),
            _fio("--name=read-ahead", f"--filename={mnt / 'seq.bin'}", "--size=32m",
                 "--rw=read", "--bs=128k", "--invalidate=1", "--time_based", "--runtime=4"),
            _fio("--name=root-disk", f"--filename={data_file}", "--rw=randrw", "--bs=64k",
                 "--direct=1", "--time_based", "--runtime=4"),
        ]
        top = FioReads(reads, size=4096, depth=32, runtime_s=4, pattern="randread")
        assert top.report()["total_ios"] > 0
        for other in others:
            assert other.wait() == 0
        _idle(disk)
        t1, after = time.monotonic_ns(), _stat(disk)
    result = probe.result("t")
    rows = result.block_io[result.block_io["complete_ns"].between(t0, t1)]
    counted = {op: after[field] - before[field] for op, field in STAT.items()}
    # the device is idle at both reads: a request the probe followed and saw no end of, still
    # open at stop, ended unseen as well (so did every complete_missed)
    unseen = {op: result.lost_by_op["complete_missed"][op]
              + result.lost_by_op["unfinished_at_stop"][op] for op in STAT}
    rowed = {op: int((rows["op"] == op).sum()) for op in STAT}
    assert counted["R"] > 10_000 and counted["W"] > 0 and counted["F"] > 0, counted
    assert {k: result.lost_events[k] for k in ("ringbuf_full", "map_full")} == \
        {"ringbuf_full": 0, "map_full": 0}, result.lost_events
    assert {op: rowed[op] + unseen[op] for op in STAT} == counted, (rowed, unseen, counted)
