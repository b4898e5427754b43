"""contract.manifest: every producer's manifest has the keys the run directory requires, made
the same way (the run id is the directory's name, created_at UTC to the second)."""

from __future__ import annotations

from datetime import datetime, timezone

from kvscope.contract import manifest, rundir
from kvscope.contract.clock import ClockOffset


def test_a_new_manifest_has_every_required_key_made_one_way(tmp_path):
    made = manifest.new(f"{tmp_path}/runs/study-7/", machine={"cpus": 2},
                        clock=ClockOffset(123, 4), workload={"phases": ["cold"]},
                        command=["kvscope", "run"], server={"started_by": "user"})
    assert set(rundir.REQUIRED_MANIFEST_KEYS) - {"schema_version"} <= set(made)
    assert made["run_id"] == "study-7"
    created = datetime.fromisoformat(made["created_at"])
    assert created.tzinfo == timezone.utc and created.microsecond == 0
    assert made["clock"] == {"offset_ns": 123, "uncertainty_ns": 4}
    assert (made["command"], made["server"], made["phases"]) == (
        ["kvscope", "run"], {"started_by": "user"}, [])
    run = rundir.create(tmp_path / "run", made)
    assert rundir.validate(run) == [f"{rundir.TABLES['requests'].file} is missing"]
