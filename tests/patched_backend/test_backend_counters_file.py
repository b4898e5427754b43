# SPDX-License-Identifier: Apache-2.0
"""The backend's counters reach the run directory by themselves (tracing on or off)."""

# Standard
import json
import time

# First Party
from kvscope.contract import rundir
from kvscope.contract.env import ENV_BACKEND_STATS_DIR
from kvscope.patched_backend.parallel_disk import statsfile
from kvscope.capture.workload.observers import DiskBackendObserver


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
