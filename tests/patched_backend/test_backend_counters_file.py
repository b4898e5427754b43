# SPDX-License-Identifier: Apache-2.0
"""The backend's counters reach the run directory by themselves (tracing on or off)."""

import json
import os
import time

import pytest

from kvscope.capture.workload.observers import DiskBackendObserver
from kvscope.contract import rundir
from kvscope.contract.env import ENV_BACKEND_STATS_DIR
from kvscope.patched_backend.parallel_disk import statsfile


def test_a_backend_writes_its_counters_where_the_run_says(harness, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_BACKEND_STATS_DIR, str(tmp_path / "backend"))
    h = harness()
    h.put([0, 1])
    h.get([0, 1, 2])
    statsfile.write(tmp_path / "backend")  # now, not at the writer's next turn
    counters = statsfile.totals(tmp_path / "backend")
    assert counters["stores"] == 2 and counters["read_hits"] == 2
    assert counters["read_misses"] == 1 and counters["corrupt_by_reason"] == {}


def _process_file(directory, pid, written_ns, **counters):
    directory.mkdir(exist_ok=True)
    body = {"pid": pid, "written_ns": written_ns,
            "backends": [{"read_hits": 0, "corrupt_chunks": 0, "corrupt_by_reason": {},
                          **counters}]}
    (directory / f"{pid}.json").write_text(json.dumps(body))


def test_the_driver_sums_every_process_into_the_manifest_per_phase(tmp_path):
    run = rundir.create(tmp_path / "run", {"run_id": "run"})
    observer = DiskBackendObserver(run)
    assert observer.server_env() == {ENV_BACKEND_STATS_DIR: str(run / "backend")}
    observer.start_phase(run, "warm", None)
    observer.stop_phase()
    assert "disk_backend" not in rundir.read_manifest(run)  # no kvscope backend ran
    far_ahead = time.monotonic_ns() + 10**12  # written after the phase ends, whenever it does
    _process_file(run / "backend", 11, far_ahead, read_hits=3, corrupt_chunks=1,
                  corrupt_by_reason={"checksum": 1})
    _process_file(run / "backend", 12, far_ahead, read_hits=4)
    observer.start_phase(run, "cold", None)
    observer.stop_phase()
    section = rundir.read_manifest(run)["disk_backend"]
    assert section["counters"]["read_hits"] == 7 and section["counters"]["corrupt_chunks"] == 1
    assert section["counters"]["corrupt_by_reason"] == {"checksum": 1}
    assert list(section["by_phase"]) == ["cold"]


def test_waiting_for_an_update_gives_up_on_a_stopped_process(tmp_path):
    _process_file(tmp_path, 11, time.monotonic_ns())
    assert statsfile.wait_for_update(tmp_path, time.monotonic_ns(), timeout_s=0.2) is False
    assert statsfile.wait_for_update(tmp_path, 0, timeout_s=0.2) is True


@pytest.mark.root
def test_a_stats_directory_of_another_user_gets_no_files_and_the_backend_serves(
        harness, shared_tmp, as_nobody, monkeypatch, capfd):
    planted = shared_tmp / "backend-stats"
    as_nobody("mkdir", "-m", "777", str(planted))
    monkeypatch.setenv(ENV_BACKEND_STATS_DIR, str(planted))
    h = harness()
    h.put([0])
    assert h.get([0])[0] is not None
    h.close()
    assert os.listdir(planted) == []
    lines = [line for line in capfd.readouterr().err.splitlines()  # LMCache's own handler
             if "counters are not written" in line]
    assert len(lines) == 1 and str(planted) in lines[0] and "uid 65534" in lines[0]


def test_files_of_another_shape_are_refused_by_name_not_summed(tmp_path):
    _process_file(tmp_path, 11, 5, read_hits=2)
    (tmp_path / "12.json").write_text("[1, 2]")
    (tmp_path / "13.json").write_text(json.dumps({"backends": [{"read_hits": "many"}]}))
    (tmp_path / "14.json").symlink_to("/dev/zero")
    processes, refused = statsfile.read_files(tmp_path)
    assert statsfile.sum_files(processes)["read_hits"] == 2
    assert statsfile.totals(tmp_path)["read_hits"] == 2
    assert len(refused) == 3, refused
    assert f"{tmp_path / '12.json'}: field (top level): [1, 2] is not of type 'object'" in refused
    assert any(f"{tmp_path / '13.json'}: field backends.0.read_hits" in r for r in refused)
    assert any(f"{tmp_path / '14.json'} is a symbolic link" in r for r in refused)


def test_a_closed_backend_is_not_counted_in_the_process_later(harness, tmp_path, monkeypatch):
    """Its object may outlive close() (reference cycles) until the garbage collector runs; the
    totals of whatever this process opens next must not depend on when that is."""
    monkeypatch.setenv(ENV_BACKEND_STATS_DIR, str(tmp_path / "backend"))
    first = harness(tmp_path / "first")
    first.put([0])
    first.close()
    held = first.backend  # still referenced, as a cycle would keep it
    second = harness(tmp_path / "second")
    second.put([1, 2])
    statsfile.write(tmp_path / "backend")
    assert statsfile.totals(tmp_path / "backend")["stores"] == 2, held
