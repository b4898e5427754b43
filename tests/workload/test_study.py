"""The demo's study tables: headline per profile and cold phase, verdict, report."""

from __future__ import annotations

import math

import pytest

from analysis import outputs, synthetic
from kvscope import rundir, study


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("study")
    made = {}
    for seed, profile in enumerate((study.BASELINE, study.CANDIDATE)):
        run = synthetic.make_run(base / profile, n_requests=40, seed=seed, phases=("cold",))
        rundir.update_manifest(run, "device_ceiling", {"bytes_per_s": 4e9})
        # What `kvscope run` records about the model, workload and machine.
        rundir.update_manifest(run, "model", {"twin": "tiny", "kv_bytes_per_token": 1024,
                                              "kv_bytes_per_chunk": 262144})
        rundir.update_manifest(run, "workload", {"num_requests": 40, "prompt_tokens": 600,
                                                 "concurrency": [4]})
        rundir.update_manifest(run, "machine", {"hostname": "h", "cpus": 2, "disk_device": "vda"})
        outputs.analyze(run, plots=False)
        made[profile] = run
    return made


def test_headline_has_one_row_per_profile_and_cold_phase(runs):
    table = study.headline(runs)
    assert sorted(table["profile"]) == sorted(runs)
    assert (table["ceiling_GBps"] == 4.0).all()
    serial = table[table["profile"] == study.BASELINE].iloc[0]
    parallel = table[table["profile"] == study.CANDIDATE].iloc[0]
    assert serial["speedup_vs_serial"] == 1.0
    assert parallel["speedup_vs_serial"] == pytest.approx(
        serial["ttft_p50_s"] / parallel["ttft_p50_s"])
    assert 0 < parallel["disk_busy_share"] <= 1
    assert math.isclose(parallel["read_vs_ceiling"], parallel["read_GBps"] / 4.0)


def test_verdict_and_report_name_the_limit(runs, tmp_path):
    table = study.headline(runs)
    lines = study.verdict(table)
    assert len(lines) == 1 and lines[0].startswith("c=")
    report = study.write_report(tmp_path, runs, table).read_text()
    assert "## Headline" in report and "## Serial vs parallel" in report
    assert lines[0] in report
