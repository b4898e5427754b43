# SPDX-License-Identifier: Apache-2.0
"""The API `kvscope run` calls around each phase, and `kvscope probe`, on real devices (root)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.contract import rundir
from kvscope.probes import session
from kvscope.probes.block import disk_holding

pytestmark = pytest.mark.root

KVSCOPE = [sys.executable, "-m", "kvscope.cli"]


def test_session_appends_phases_and_records_the_mode(run_dir: Path, workload,
                                                     loop_device: Path) -> None:
    for phase, count in (("warm", 23), ("cold", 29)):
        w = workload(loop_device, count=count, size=65536, depth=3)
        with session.start(run_dir, phase, pids=[w.pid], devices=[loop_device.name]) as s:
            assert s.plan is not None and s.fallback is None
            assert w.go() == count
    block = rundir.read_table(run_dir, "block_io")
    assert block.groupby("phase").size().to_dict() == {"warm": 23, "cold": 29}
    depth = rundir.read_table(run_dir, "queue_depth")
    assert set(depth["source"]) == {"bpf"} and depth["inflight"].max() == 3
    probes = rundir.read_manifest(run_dir)["probes"]
    assert probes["mode"] == "bpf"
    phase_lost = [n for p in probes["phases"].values() for n in p["lost_events"].values()]
    assert probes["lost_events"] == sum(phase_lost)
    assert "tp_btf:block:block_io_start" in probes["tracepoints"]
    assert probes["phases"]["cold"]["rows"]["block_io"] == 29
    table_problems = [p for p in rundir.validate(run_dir) if ".parquet" in p]
    assert table_problems == ["requests.parquet is missing"]  # ours are schema v1


def test_session_rejects_bad_devices_pids_and_runs(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nosuchdisk"):
        session.start(run_dir, "p", devices=["nosuchdisk"])
    with pytest.raises(ValueError, match="pid 999999999: no such process"):
        session.start(run_dir, "p", pids=[999999999])
    with pytest.raises(ValueError, match="not on a block device"):
        disk_holding(Path("/proc/self"))
    with pytest.raises(rundir.RunDirError, match="not a kvscope run directory"):
        session.start(tmp_path / "nothing", "p")


def test_without_bpf_privileges_falls_back_to_the_sampler_and_says_why(tmp_path: Path) -> None:
    # root minus the capabilities BPF needs: what an unprivileged user gets (the venv's
    # interpreter lives under /root, which other users cannot reach on this machine)
    drop = "-sys_admin,-bpf,-perfmon"
    out = tmp_path / "run"
    proc = subprocess.run(
        ["setpriv", "--bounding-set", drop, "--inh-caps", drop, *KVSCOPE, "probe", "--out",
         str(out), "--duration", "0.5"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "not running as root" in proc.stderr and "To fix" in proc.stderr
    probes = rundir.read_manifest(out)["probes"]
    assert probes["mode"] == "fallback-sampler" and "not running as root" in probes["why_fallback"]
    assert rundir.read_table(out, "block_io") is None  # no per-request rows, and no empty table
    depth = rundir.read_table(out, "queue_depth")
    assert len(depth) > 0 and set(depth["source"]) == {"sysfs"}
    assert "vda" in probes["phases"]["probe"]["diskstats"]


def test_cli_sigint_detaches_and_writes_the_tables(tmp_path: Path, workload,
                                                   loop_device: Path) -> None:
    w = workload(loop_device, count=31, size=65536, depth=2)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*KVSCOPE, "probe", "--out", str(out), "-p", str(w.pid), "-d", loop_device.name,
         "--phase", "cold"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert "recording (BPF)" in proc.stderr.readline()
    assert w.go() == 31
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "mode bpf" in stdout
    block = rundir.read_table(out, "block_io")
    manifest = rundir.read_manifest(out)
    assert len(block) == 31, manifest["probes"]
    assert set(block["phase"]) == {"cold"}
    assert manifest["phases"][0]["name"] == "cold" and manifest["workload"]["probe_only"]
    assert json.dumps(manifest)  # plain JSON all the way down


def test_cli_ebpf_prints_the_program_it_would_load() -> None:
    out = subprocess.run([*KVSCOPE, "probe", "--out", "unused", "--ebpf", "-p", "1"],
                         check=True, capture_output=True, text=True).stdout
    assert "int pio_start(u64 *ctx)" in out and "#define FILTER_PIDS 1" in out
    assert "#define TP_BTF 1" in out  # this kernel has BTF-typed tracepoints
