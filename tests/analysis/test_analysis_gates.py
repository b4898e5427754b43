"""Acceptance gates (`kvscope check CANDIDATE --against BASELINE --gates FILE`) on synthetic
runs whose candidate is a known factor faster: exit codes, printed verdicts, JUnit content."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from xml.etree import ElementTree

import pandas as pd
import pytest

from kvscope.analysis import acceptance, outputs
from kvscope.testkit import synthetic
from kvscope.analysis.attribution import COMPONENTS
from kvscope.contract import rundir
from kvscope.cli import main

FASTER = 0.7  # the candidate takes 70 % of the baseline's time: TTFT -30 %, throughput 1/0.7


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A baseline run and the same run with every time compressed by FASTER."""
    root = tmp_path_factory.mktemp("gates")
    base = synthetic.make_run(root / "base", n_requests=64, seed=5, concurrency=8,
                              phases=("cold",), hit_ratio=1.0)
    outputs.analyze(base, plots=False)
    cand = Path(shutil.copytree(base, root / "cand"))
    att = pd.read_parquet(cand / outputs.ATTRIBUTION_FILE)
    for c in ("ttft", *COMPONENTS):
        att[f"{c}_ns"] = (att[f"{c}_ns"] * FASTER).round().astype("int64")
    att.to_parquet(cand / outputs.ATTRIBUTION_FILE, index=False)
    req = rundir.read_table(cand, "requests")
    t0 = req["arrival_ns"].min()
    for c in ("arrival_ns", "first_token_ns", "finish_ns"):
        req[c] = t0 + ((req[c] - t0) * FASTER).round().astype("int64")
    req.to_parquet(rundir.table_path(cand, "requests"), index=False)
    return base, cand


def gate_file(tmp_path: Path, **bounds) -> Path:
    gates = {"name": "test gates", "gates": [
        {"name": "TTFT p50 reduction", "phase": "cold", "metric": "reduction",
         "min": bounds.get("reduction", 0.25)},
        {"name": "throughput ratio", "phase": "cold", "metric": "throughput_ratio",
         "rate": "requests_per_s", "min": bounds.get("throughput", 1.29)},
        {"name": "storage_read share", "phase": "cold", "metric": "share",
         "component": "storage_read", "max": bounds.get("share", 0.99)}]}
    path = tmp_path / "gates.json"
    path.write_text(json.dumps(gates))
    return path


def test_a_faster_candidate_passes_and_the_values_are_exact(pair, tmp_path, capsys):
    base, cand = pair
    junit = tmp_path / "gates.xml"
    assert main(["check", str(cand), "--against", str(base), "--gates",
                 str(gate_file(tmp_path)), "--junit", str(junit)]) == 0
    out = capsys.readouterr().out
    assert "all 3 gates pass" in out
    suite = ElementTree.parse(junit).getroot()
    assert suite.get("tests") == "3" and suite.get("failures") == "0"
    result = acceptance.check(acceptance.read_gates(gate_file(tmp_path)),
                              *({"attribution": outputs.load_attribution(r),
                                 "requests": rundir.read_table(r, "requests")} for r in pair))
    values = dict(zip(result["gate"], result["value"]))
    assert values["TTFT p50 reduction"] == pytest.approx(1 - FASTER, abs=1e-6)
    assert values["throughput ratio"] == pytest.approx(1 / FASTER, rel=1e-6)


def test_a_missed_gate_exits_1_and_junit_names_it(pair, tmp_path, capsys):
    base, cand = pair
    junit = tmp_path / "gates.xml"
    assert main(["check", str(cand), "--against", str(base), "--gates",
                 str(gate_file(tmp_path, throughput=1.5)), "--junit", str(junit)]) == 1
    assert "1 of 3 gates failed" in capsys.readouterr().out
    suite = ElementTree.parse(junit).getroot()
    assert suite.get("failures") == "1"
    failed = [c for c in suite if c.find("failure") is not None]
    assert [c.get("name") for c in failed] == ["throughput ratio"]
    message = failed[0].find("failure").get("message")
    assert "1.4286 is not >= 1.5" in message and "95 % CI of the ratio" in message
    # The baseline against itself misses the reduction gate too.
    assert main(["check", str(base), "--against", str(base), "--gates",
                 str(gate_file(tmp_path))]) == 1


def test_bad_gate_files_and_arguments_exit_2_naming_the_problem(pair, tmp_path, capsys):
    base, cand = pair
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gates": [{"name": "g", "phase": "cold", "metric": "vibes",
                                          "min": 1}]}))
    assert main(["check", str(cand), "--against", str(base), "--gates", str(bad)]) == 2
    assert "metric, one of" in capsys.readouterr().err
    wrong_phase = gate_file(tmp_path)
    wrong_phase.write_text(wrong_phase.read_text().replace('"cold"', '"cold-c64"'))
    assert main(["check", str(cand), "--against", str(base), "--gates", str(wrong_phase)]) == 2
    assert "cold-c64" in capsys.readouterr().err
    assert main(["check", str(cand), "--gates", str(bad)]) == 2
    assert "--against" in capsys.readouterr().err


def test_the_shipped_seeds_gate_file_reads():
    gates = acceptance.read_gates(acceptance.EXAMPLE)
    by_metric = {g["metric"]: g for g in gates["gates"]}
    assert by_metric["reduction"]["min"] == 0.25 and by_metric["reduction"]["phase"] == "cold-c16"
    assert by_metric["throughput_ratio"]["min"] == 1.29
    assert by_metric["share"]["max"] == 0.5
