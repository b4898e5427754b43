# SPDX-License-Identifier: Apache-2.0
"""The aggregate (always-on) probe on real block devices (root): exact counts against the
kernel's own /sys/block/<dev>/stat, and histograms that agree with the per-I/O probe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvscope.contract import rundir
from kvscope.probes import session
from kvscope.probes.aggregate import AggregateProbe
from kvscope.probes.block import BlockProbe
from kvscope.probes.block_bpf import BlockOptions
from test_probes_block_live import _loaded_after_release

pytestmark = pytest.mark.root

COUNT, SIZE, DEPTH = 53, 65536, 4  # a prime count: nothing else produces exactly 53 reads
KVSCOPE = [sys.executable, "-m", "kvscope.cli"]


def sys_stat(device: str) -> dict[str, int]:
    """Reads, read bytes and writes completed, from /sys/block/<dev>/stat (iostats.rst)."""
    fields = [int(v) for v in Path(f"/sys/block/{device}/stat").read_text().split()]
    return {"reads": fields[0], "read_bytes": fields[2] * 512, "writes": fields[4]}


def _totals(result, device: str, pid: int = -1) -> pd.DataFrame:
    t = result.totals
    return t[(t["device"] == device) & (t["pid"] == pid)].set_index("op")


def _slots(hist: pd.DataFrame, kind: str) -> dict[int, int]:
    rows = hist[hist["kind"] == kind]
    return dict(zip(rows["slot"].astype(int), rows["count"].astype(int)))


def _cdf(slots: dict[int, int]) -> np.ndarray:
    counts = np.zeros(34)
    for slot, n in slots.items():
        counts[slot] += n
    return np.cumsum(counts) / counts.sum()


@pytest.mark.parametrize("tracked", [False, True], ids=["no-rows", "rows-for-the-workload"])
def test_device_counts_equal_the_kernels_disk_stats(workload, loop_device: Path,
                                                    tracked: bool) -> None:
    device = loop_device.name
    w = workload(loop_device, count=COUNT, size=SIZE, depth=DEPTH)
    before = sys_stat(device)
    with AggregateProbe(track=[w.pid] if tracked else None, devices=[device]) as probe:
        assert w.go() == COUNT
    after = sys_stat(device)
    result = probe.result("t")
    mine = _totals(result, device)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["reads"] == COUNT  # nothing else read the loop device meanwhile
    assert mine.loc["R", "ios"] == delta["reads"]
    assert mine.loc["R", "bytes"] == delta["read_bytes"] == COUNT * SIZE
    assert set(mine.index) == {"R"} and delta["writes"] == 0
    assert mine.loc["R", "no_start"] == 0 and mine.loc["R", "no_issue"] == 0
    hist = result.histograms[(result.histograms["device"] == device)
                             & (result.histograms["pid"] == -1)]
    assert sum(_slots(hist, "service").values()) == COUNT
    assert sum(_slots(hist, "queue").values()) == COUNT
    lost = {k: v for k, v in result.lost_events.items() if k != "complete_nested"}
    assert lost == {"ringbuf_full": 0, "map_full": 0, "disk_added": 0, "bad_record_size": 0,
                    "recursion_misses": 0}
    assert len(result.block_io) == (COUNT if tracked else 0)


def test_histograms_agree_with_the_per_io_probe_on_the_same_reads(workload,
                                                                  loop_device: Path) -> None:
    device = loop_device.name
    w = workload(loop_device, count=COUNT, size=SIZE, depth=DEPTH)
    with AggregateProbe(track=[w.pid], devices=[device]) as agg, \
            BlockProbe(BlockOptions(), pids=[w.pid], devices=[device]) as per_io:
        assert w.go() == COUNT
    a, p = agg.result("t"), per_io.result("t")
    per_io_hist = p.histograms
    device_hist = a.histograms[(a.histograms["device"] == device) & (a.histograms["pid"] == -1)]
    process_hist = a.histograms[(a.histograms["device"] == device)
                                & (a.histograms["pid"] == w.pid)]
    for kind in ("queue", "service"):
        # the same requests in every histogram: the workload's, and only they use the device
        assert sum(_slots(device_hist, kind).values()) == COUNT
        assert sum(per_io_hist[f"{kind}_us"][device].values()) == COUNT
        assert _slots(process_hist, kind) == _slots(device_hist, kind)
    # service: the kernel's io_start_time_ns may be a plug-cached time before the issue the
    # per-I/O probe saw, never after it; the two distributions differ by at most one log2
    # bucket (each CDF within one slot of the other, 10 % of the requests allowed beyond)
    kernel, own = _cdf(_slots(device_hist, "service")), _cdf(per_io_hist["service_us"][device])
    assert (kernel[1:] >= own[:-1] - 0.1).all() and (own[1:] >= kernel[:-1] - 0.1).all()
    assert (kernel <= own + 0.1).all()  # kernel service times are not the shorter ones
    # queue: the kernel stamps both ends with one cached time when the request is issued from
    # the submitter's plug, so its queue times are at most the per-I/O probe's
    assert (_cdf(_slots(device_hist, "queue")) >= _cdf(per_io_hist["queue_us"][device]) - 1e-9).all()
    # the rows of the tracked reads are the per-I/O probe's requests
    rows = a.block_io.sort_values("sector", ignore_index=True)
    ref = p.block_io.sort_values("sector", ignore_index=True)
    assert len(rows) == len(ref) == COUNT
    assert rows["sector"].tolist() == ref["sector"].tolist()
    assert (rows["tid"] == ref["tid"]).all() and set(rows["pid"]) == {w.pid}
    assert set(rows["bytes"]) == {SIZE} and set(rows["op"]) == {"R"}
    assert (rows["start_ns"] - ref["start_ns"]).abs().max() < 50_000
    assert (rows["complete_ns"] - ref["complete_ns"]).abs().max() < 50_000
    assert (rows["issue_ns"] >= rows["start_ns"]).all()
    assert (rows["complete_ns"] > rows["issue_ns"]).all()
    assert (rows["issue_ns"] <= ref["issue_ns"] + 50_000).all()


def test_tracked_thread_ids_select_rows(workload, loop_device: Path) -> None:
    """Rows follow the ids given: the other process's reads are counted, not emitted."""
    device = loop_device.name
    first = workload(loop_device, count=COUNT, size=SIZE, depth=DEPTH)
    second = workload(loop_device, count=29, size=SIZE, depth=2)
    with AggregateProbe(track=[second.pid], devices=[device]) as probe:
        assert first.go() == COUNT
        assert second.go() == 29
    result = probe.result("t")
    assert _totals(result, device).loc["R", "ios"] == COUNT + 29
    assert _totals(result, device, second.pid).loc["R", "ios"] == 29
    assert set(result.totals["pid"]) == {-1, second.pid}
    assert len(result.block_io) == 29 and set(result.block_io["pid"]) == {second.pid}


def test_only_the_completion_program_runs_without_tracked_ids(loop_device: Path) -> None:
    probe = AggregateProbe(devices=[loop_device.name]).start()
    try:
        ids = probe.program_ids()
        assert len(ids) == 1
        assert probe.tracepoints == ["tp_btf:block:block_rq_complete"]
    finally:
        probe.stop()
    probe.stop()  # idempotent
    with AggregateProbe(track=[1], devices=[loop_device.name]) as tracking:
        ids += tracking.program_ids()
        assert len(ids) == 4  # + block_io_start, _rq_merge, _rq_complete
    assert not set(ids) & _loaded_after_release(set(ids))  # every program unloaded


def test_session_aggregate_mode_writes_its_tables(run_dir: Path, workload,
                                                  loop_device: Path) -> None:
    device = loop_device.name
    for phase, tracked in (("warm", False), ("cold", True)):
        w = workload(loop_device, count=COUNT, size=SIZE, depth=DEPTH)
        with session.start(run_dir, phase, pids=[w.pid] if tracked else None,
                           devices=[device], mode="aggregate") as s:
            assert s.aggregate is not None and s.fallback is None
            assert w.go() == COUNT
    totals = rundir.read_table(run_dir, "io_totals")
    reads = totals[(totals["device"] == device) & (totals["pid"] == -1) & (totals["op"] == "R")]
    assert reads.set_index("phase")["ios"].to_dict() == {"warm": COUNT, "cold": COUNT}
    hist = rundir.read_table(run_dir, "io_histograms")
    assert set(hist["phase"]) == {"warm", "cold"} and set(hist["kind"]) == {"queue", "service"}
    block = rundir.read_table(run_dir, "block_io")
    assert set(block["phase"]) == {"cold"} and len(block) == COUNT  # rows only when tracked
    depth = rundir.read_table(run_dir, "queue_depth")
    assert set(depth["source"]) == {"sysfs"} and set(depth["device"]) == {device}
    probes = rundir.read_manifest(run_dir)["probes"]
    assert probes["mode"] == "bpf" and probes["probe_mode"] == "aggregate"
    assert probes["phases"]["warm"]["tracepoints"] == ["tp_btf:block:block_rq_complete"]
    assert probes["phases"]["cold"]["rows"]["block_io"] == COUNT
    assert [p for p in rundir.validate(run_dir) if ".parquet" in p] == \
        ["requests.parquet is missing"]
    with pytest.raises(ValueError, match="probe mode 'sampled'"):
        session.start(run_dir, "p", mode="sampled")


def test_cli_aggregate_mode(tmp_path: Path, workload, loop_device: Path) -> None:
    w = workload(loop_device, count=31, size=SIZE, depth=2)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*KVSCOPE, "probe", "--out", str(out), "--mode", "aggregate", "--pids", f"{w.pid},1",
         "-d", loop_device.name], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert "recording (BPF, aggregate)" in proc.stderr.readline()
    assert w.go() == 31
    proc.send_signal(2)  # SIGINT
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "mode bpf" in stdout
    assert len(rundir.read_table(out, "block_io")) == 31
    totals = rundir.read_table(out, "io_totals")
    assert totals[(totals["pid"] == w.pid)]["ios"].sum() == 31
    assert json.dumps(rundir.read_manifest(out))


READER = r"""
import mmap, os, sys, threading
path, main_reads, thread_reads, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 65536
def read(n, first):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, size)
    for i in range(n):
        os.preadv(fd, [buf], (first + 2 * i) * size)  # a gap after each: no merging
    os.close(fd)
go = threading.Event()
worker = threading.Thread(target=lambda: (go.wait(), read(thread_reads, 0)))
worker.start()
print(worker.native_id, flush=True)
sys.stdin.readline()
go.set()
read(main_reads, 1)
worker.join()
"""


def test_a_tracked_thread_gets_rows_its_process_siblings_do_not(loop_device: Path) -> None:
    """A reader thread's id selects that thread's reads only (the server's reader threads)."""
    proc = subprocess.Popen([sys.executable, "-c", READER, str(loop_device), "17", "23"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tid = int(proc.stdout.readline())
    assert tid != proc.pid
    with AggregateProbe(track=[tid], devices=[loop_device.name]) as probe:
        assert probe.opts.track_threads
        proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0
    result = probe.result("t")
    assert _totals(result, loop_device.name).loc["R", "ios"] == 17 + 23
    assert len(result.block_io) == 23 and set(result.block_io["tid"]) == {tid}
    assert set(result.block_io["pid"]) == {proc.pid}
    assert _totals(result, loop_device.name, proc.pid).loc["R", "ios"] == 23  # under its tgid
