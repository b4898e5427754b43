"""The disk read idle and with every CPU busy, side by side (root: drop_caches, O_DIRECT)."""

from __future__ import annotations

import os

import pytest

from kvscope.capture import ceiling

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="drops the page cache: needs root")


def _spinners() -> set[int]:
    """Our spinning children still alive (a /proc scan: they must be gone afterwards)."""
    me = str(os.getpid())
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if fields[1] == me and b"while True: pass" in cmdline and fields[0] != "Z":
            found.add(int(pid))
    return found


def test_cpus_busy_runs_niced_spinners_and_reaps_them():
    with ceiling.cpus_busy(2):
        alive = _spinners()
        assert len(alive) == 2
        assert all(os.getpriority(os.PRIO_PROCESS, pid) == 19 for pid in alive)
    assert _spinners() == set()


def test_measure_busy_reads_the_files_idle_and_busy_alternately(tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir()
    for i in range(4):
        (kv / f"chunk{i}.bin").write_bytes(os.urandom(8 << 20))
    taken = ceiling.measure_busy(kv, unit=1 << 20, depth=4, reps=2)
    assert taken is not None
    assert taken["busy_cpus"] == len(os.sched_getaffinity(0))
    assert len(taken["idle_samples"]) == len(taken["busy_samples"]) == 2
    assert all(r > 0 for r in taken["idle_samples"] + taken["busy_samples"])
    assert taken["ratio"] == pytest.approx(taken["busy_bytes_per_s"] / taken["idle_bytes_per_s"])
    assert (taken["unit"], taken["depth"]) == (1 << 20, 4)
    assert _spinners() == set()
    assert ceiling.measure_busy(tmp_path / "empty", unit=1 << 20, depth=4) is None
