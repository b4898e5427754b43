"""The run directory contract: create, append, validate, and clear errors on bad directories."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from kvscope.contract import rundir
from kvscope.capture.workload.client import RequestRecord
from kvscope.capture.workload.runner import expected_chunks, plan_phases

MANIFEST = {k: {} for k in rundir.REQUIRED_MANIFEST_KEYS if k != "schema_version"}


def _requests(n: int, phase: str) -> pd.DataFrame:
    rows = [RequestRecord(f"r{i}", phase, 1, i, "0" * 32, status="ok").as_row() for i in range(n)]
    return pd.DataFrame(rows)


def test_create_append_validate(tmp_path):
    run = rundir.create(tmp_path / "run", {**MANIFEST, "phases": []})
    rundir.append_table(run, "requests", _requests(3, "warm"))
    rundir.append_table(run, "requests", _requests(2, "cold"))
    assert rundir.validate(run) == []
    assert rundir.read_table(run, "requests")["phase"].tolist() == ["warm"] * 3 + ["cold"] * 2
    rundir.update_manifest(run, "probes", {"mode": "bpf"})
    assert rundir.read_manifest(run)["probes"] == {"mode": "bpf"}


def test_validate_names_what_is_wrong(tmp_path):
    run = rundir.create(tmp_path / "run", {"run_id": "x"})
    rundir.append_table(run, "requests", _requests(1, "warm").astype({"ttft_s": str}))
    problems = rundir.validate(run)
    assert f"{rundir.MANIFEST}: missing key clock" in problems
    assert any("column ttft_s" in p for p in problems)


def test_rows_missing_columns_are_refused(tmp_path):
    run = rundir.create(tmp_path / "run", MANIFEST)
    with pytest.raises(rundir.RunDirError, match="lack columns"):
        rundir.append_table(run, "block_io", pd.DataFrame({"phase": ["cold"]}))


@pytest.mark.parametrize(("content", "message"), [
    (None, "not a kvscope run directory"),
    ("{not json", "is not valid JSON"),
    (json.dumps({"schema_version": 99}), "has schema_version 99"),
])
def test_unreadable_manifest(tmp_path, content, message):
    if content is not None:
        (tmp_path / rundir.MANIFEST).write_text(content)
    with pytest.raises(rundir.RunDirError, match=message):
        rundir.read_manifest(tmp_path)


def test_refuses_to_overwrite_a_run(tmp_path):
    rundir.create(tmp_path / "run", MANIFEST)
    with pytest.raises(rundir.RunDirError, match="already holds a run"):
        rundir.create(tmp_path / "run", MANIFEST)


def test_phase_plan_labels_are_unique():
    assert [p.label for p in plan_phases(["warm", "cold"], [4])] == ["warm", "cold"]
    plan = plan_phases(["warm", "cold"], [1, 8, 16])
    assert [(p.label, p.concurrency) for p in plan] == [
        ("warm", 1), ("cold-c1", 1), ("cold-c8", 8), ("cold-c16", 16)]
    assert plan_phases(["warm"], [1], warm_concurrency=4)[0].concurrency == 4
    with pytest.raises(ValueError, match="warm and/or cold"):
        plan_phases(["hot"], [1])


def test_expected_chunks_counts_distinct_full_chunk_prefixes():
    shared = list(range(256))
    prompts = [shared + [1000 + i] * 300 for i in range(3)]  # 556 tokens: 2 full chunks each
    assert expected_chunks(prompts) == 1 + 3  # the shared first chunk is stored once
    assert expected_chunks([list(range(255))]) == 0


def test_a_new_run_is_private(tmp_path):
    run = rundir.create(tmp_path / "a" / "run", MANIFEST)
    modes = [oct(p.stat().st_mode & 0o777) for p in (tmp_path / "a", run, run / rundir.SPANS_DIR)]
    assert modes == ["0o700"] * 3
    assert oct((run / rundir.MANIFEST).stat().st_mode & 0o777) == "0o600"


def test_an_empty_directory_of_ours_may_hold_the_run_but_nothing_else(tmp_path):
    (tmp_path / "empty").mkdir(mode=0o700)
    rundir.create(tmp_path / "empty", MANIFEST)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(rundir.RunDirError, match="is not empty"):
        rundir.create(tmp_path / "full", MANIFEST)
    (tmp_path / "file").write_text("")
    with pytest.raises(rundir.RunDirError, match="is not a directory"):
        rundir.create(tmp_path / "file", MANIFEST)


@pytest.mark.root
def test_out_prepared_by_another_user_is_refused_and_nothing_written_through_it(
        shared_tmp, as_nobody, tmp_path):
    """Issue 19: with --out in a world-writable directory, a planted prod/spans and prod/.lock
    made root overwrite a root file and create files where the attacker chose."""
    victim = tmp_path / "root-config"
    victim.write_text("setting = 1\n")
    victim_dir = tmp_path / "root-dir"
    victim_dir.mkdir(mode=0o700)
    prod = shared_tmp / "prod"
    as_nobody("mkdir", "-m", "777", str(prod))
    as_nobody("ln", "-s", str(victim_dir), str(prod / rundir.SPANS_DIR))
    as_nobody("ln", "-s", str(victim), str(prod / ".lock"))
    with pytest.raises(rundir.RunDirError, match="owned by uid 65534"):
        rundir.create(prod, MANIFEST)
    as_nobody("ln", "-s", str(victim_dir), str(shared_tmp / "link"))
    with pytest.raises(rundir.RunDirError, match="symbolic link"):
        rundir.create(shared_tmp / "link", MANIFEST)
    assert victim.read_text() == "setting = 1\n" and os.listdir(victim_dir) == []


def test_a_lock_file_replaced_by_a_link_is_refused_not_written_through(tmp_path):
    run = rundir.create(tmp_path / "run", MANIFEST)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(victim)
    with pytest.raises(rundir.RunDirError, match=r"\.lock is a symbolic link"):
        rundir.update_manifest(run, "probes", {})
    assert victim.read_text() == "keep"
