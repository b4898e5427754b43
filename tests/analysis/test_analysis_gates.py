"""Acceptance gates (`kvscope check CANDIDATE... --against BASELINE... --gates FILE`) on
synthetic runs whose candidates are known factors faster, one per repetition: exit codes,
printed verdicts, JUnit content, and the rule they share with the study's headline."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from xml.etree import ElementTree

import pandas as pd
import pytest

from kvscope.analysis import acceptance, outputs, replicates
from kvscope.testkit import synthetic
from kvscope.analysis.attribution import COMPONENTS
from kvscope.contract import rundir
from kvscope.cli import main

FASTER = (0.69, 0.70, 0.71)  # each repetition's candidate takes this share of the baseline's time


def _faster(base: Path, out: Path, factor: float) -> Path:
    """A copy of `base` with every time compressed by `factor`."""
    cand = Path(shutil.copytree(base, out))
    att = pd.read_parquet(cand / outputs.ATTRIBUTION_FILE)
    for c in ("ttft", *COMPONENTS):
        att[f"{c}_ns"] = (att[f"{c}_ns"] * factor).round().astype("int64")
    att.to_parquet(cand / outputs.ATTRIBUTION_FILE, index=False)
    req = rundir.read_table(cand, "requests")
    t0 = req["arrival_ns"].min()
    for c in ("arrival_ns", "first_token_ns", "finish_ns"):
        req[c] = t0 + ((req[c] - t0) * factor).round().astype("int64")
    req.to_parquet(rundir.table_path(cand, "requests"), index=False)
    return cand


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """A baseline run and three candidates, the same run with every time compressed by each
    of FASTER (the baseline stands for itself in every repetition)."""
    root = tmp_path_factory.mktemp("gates")
    base = synthetic.make_run(root / "base", n_requests=64, seed=5, concurrency=8,
                              phases=("cold",), hit_ratio=1.0)
    outputs.analyze(base, plots=False)
    return base, [_faster(base, root / f"cand-r{i}", f) for i, f in enumerate(FASTER, 1)]


def argv(pair: tuple[Path, list[Path]], gates: Path, reps: int = 3) -> list[str]:
    base, cands = pair
    return ["check", *map(str, cands[:reps]), "--against", *[str(base)] * reps, "--gates",
            str(gates)]


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


def _loaded(run: Path) -> dict:
    return {"attribution": outputs.load_attribution(run),
            "requests": rundir.read_table(run, "requests")}


def test_faster_candidates_pass_and_the_values_are_their_geometric_means(pair, tmp_path, capsys):
    junit = tmp_path / "gates.xml"
    assert main([*argv(pair, gate_file(tmp_path)), "--junit", str(junit)]) == 0
    out = capsys.readouterr().out
    assert "all 3 gates pass" in out and "95 % interval across 3 repetitions" in out
    suite = ElementTree.parse(junit).getroot()
    assert suite.get("tests") == "3" and suite.get("failures") == "0"
    base, cands = pair
    result = acceptance.check(acceptance.read_gates(gate_file(tmp_path)),
                              [(_loaded(base), _loaded(c)) for c in cands])
    values = dict(zip(result["gate"], result["value"]))
    shrink = math.prod(FASTER) ** (1 / 3)
    assert values["TTFT p50 reduction"] == pytest.approx(1 - shrink, abs=1e-5)
    assert values["throughput ratio"] == pytest.approx(1 / shrink, rel=1e-5)
    assert (result["reps"] == 3).all()


def test_a_bound_inside_the_interval_fails_as_level_by_the_headlines_rule(pair, tmp_path,
                                                                          capsys):
    """The candidates' throughput ratios are 1.41-1.45: a bound of 1.42 lies inside their
    interval, so the gate fails (level with its bar) however the point estimate falls; the
    gate's status is the headline's standing against the same bar."""
    junit = tmp_path / "gates.xml"
    assert main([*argv(pair, gate_file(tmp_path, throughput=1.42)), "--junit", str(junit)]) == 1
    assert "1 of 3 gates failed or could not tell" in capsys.readouterr().out
    suite = ElementTree.parse(junit).getroot()
    failed = [c for c in suite if c.find("failure") is not None]
    assert [c.get("name") for c in failed] == ["throughput ratio"]
    message = failed[0].find("failure").get("message")
    assert "is not >= 1.42 over the whole interval" in message
    assert "95 % interval across 3 repetitions" in message
    base, cands = pair
    result = acceptance.check(acceptance.read_gates(gate_file(tmp_path, throughput=1.42)),
                              [(_loaded(base), _loaded(c)) for c in cands])
    row = result.set_index("gate").loc["throughput ratio"]
    spread = replicates.Spread(row["value"], row["lo"], row["hi"], int(row["reps"]))
    assert replicates.standing(spread, 1.42) == replicates.LEVEL
    assert row["value"] > 1.42  # the point estimate alone would have passed
    # The baseline against itself misses the reduction gate too.
    assert main(["check", str(base), str(base), "--against", str(base), str(base), "--gates",
                 str(gate_file(tmp_path))]) == 1


def test_one_repetition_passes_no_gate_and_says_the_spread_is_unknown(pair, tmp_path, capsys):
    junit = tmp_path / "gates.xml"
    assert main([*argv(pair, gate_file(tmp_path), reps=1), "--junit", str(junit)]) == 1
    out = capsys.readouterr().out
    assert "3 of 3 gates failed or could not tell" in out and out.count("UNKNOWN") == 3
    message = ElementTree.parse(junit).getroot()[0].find("failure").get("message")
    assert "one repetition: the spread across runs is unknown, so no gate passes" in message


def test_bad_gate_files_and_arguments_exit_2_naming_the_problem(pair, tmp_path, capsys):
    base, [cand, *_] = pair
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
    assert main(["check", *map(str, pair[1]), "--against", str(base), "--gates",
                 str(gate_file(tmp_path))]) == 2  # three candidates, one baseline
    assert "as many baseline runs as candidate runs" in capsys.readouterr().err


def test_the_shipped_seeds_gate_file_reads():
    gates = acceptance.read_gates(acceptance.EXAMPLE)
    by_metric = {g["metric"]: g for g in gates["gates"]}
    assert by_metric["reduction"]["min"] == 0.25 and by_metric["reduction"]["phase"] == "cold-c16"
    assert by_metric["throughput_ratio"]["min"] == 1.29
    assert by_metric["share"]["max"] == 0.5
