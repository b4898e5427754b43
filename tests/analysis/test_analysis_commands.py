"""The kvscope analyze / compare / check / whatif commands and the pytest gate plugin."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pandas as pd
import pytest

from kvscope.testkit import synthetic
from kvscope.analysis.summary import ANALYSIS_VERSION
from kvscope.contract import rundir
from kvscope.cli import main


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A and B: two runs made from the same seed, so every component is identical."""
    root = tmp_path_factory.mktemp("pair")
    a = synthetic.make_run(root / "a", n_requests=120, seed=11, hit_ratio=1.0)
    b = synthetic.make_run(root / "b", n_requests=120, seed=11, hit_ratio=1.0)
    return a, b


def test_analyze_writes_attribution_summary_report_and_plots(synthetic_run, tmp_path, capsys):
    import shutil
    run = Path(shutil.copytree(synthetic_run, tmp_path / "run"))
    assert main(["analyze", str(run)]) == 0
    attribution = pd.read_parquet(run / "attribution.parquet")
    summary = json.loads((run / "summary.json").read_text())
    assert len(attribution) == summary["requests"]["total"] == 200
    assert {g["phase"] for g in summary["groups"]} == {"warm", "cold"}
    report = (run / "report.md").read_text()
    assert report.count("plots/") == 3
    assert "## Throughput per phase" in report and "prompt tokens/s from storage" in report
    assert all((run / "plots" / f"{n}.png").stat().st_size > 1000
               for n in ("breakdown", "ttft_cdf", "queue_depth"))
    assert json.loads((run / "manifest.json").read_text())["analysis"] == {"version": ANALYSIS_VERSION}
    assert "cold (conc 4" in capsys.readouterr().out


def test_analyze_names_a_missing_run(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_compare_finds_no_difference_between_identical_runs(two_runs, capsys):
    a, b = two_runs
    assert main(["compare", str(a), str(b), "--json", "--boot", "200"]) == 0
    out = json.loads(capsys.readouterr().out)
    table = pd.DataFrame(out["components"]).set_index("component")
    assert (table["delta_s"] == 0).all() and (table.loc["ttft", "speedup"] == 1.0)
    assert table.loc["ttft", "speedup_lo"] <= 1.0 <= table.loc["ttft", "speedup_hi"]
    rates = pd.DataFrame(out["throughput"]).set_index(["phase", "metric"])
    assert set(rates.index.get_level_values("phase")) == set(rundir.read_table(a, "requests")["phase"])
    assert (rates["ratio"] == 1.0).all()
    assert main(["compare", str(a), str(b), "--phase", "cold", "--boot", "200"]) == 0
    assert "requests_per_s" in capsys.readouterr().out


def test_compare_recovers_a_known_speedup_with_a_ci_that_covers_it(tmp_path):
    from kvscope.analysis import compare
    a = synthetic.expected(synthetic.make_run(tmp_path / "a", n_requests=400, seed=5, hit_ratio=1.0))
    slow = a.copy()
    for frame in (a, slow):
        frame["phase"], frame["partial"] = "cold", False
    slow["storage_read_ns"] *= 3
    table = compare.compare(slow, a, n_boot=500).set_index("component")
    row = table.loc["storage_read"]
    assert row["speedup"] == pytest.approx(3.0)
    assert row["speedup_lo"] <= 3.0 <= row["speedup_hi"] and row["speedup_hi"] - row["speedup_lo"] < 1.5


def test_check_passes_itself_and_fails_a_slower_run_with_junit(two_runs, tmp_path, capsys):
    a, b = two_runs
    base, junit = tmp_path / "base.json", tmp_path / "junit.xml"
    assert main(["check", str(a), "--baseline", str(base), "--write-baseline"]) == 0
    assert main(["check", str(b), "--baseline", str(base), "--junit", str(junit)]) == 0
    baseline = json.loads(base.read_text())
    baseline["components"]["storage_read"]["value_s"] /= 2  # B now looks 2x slower
    base.write_text(json.dumps(baseline))
    assert main(["check", str(b), "--baseline", str(base), "--junit", str(junit)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSED" in out and "1 regression(s)" in out
    suite = ElementTree.parse(junit).getroot()
    assert suite.get("failures") == "1"
    assert [c.get("name") for c in suite if c.find("failure") is not None] == ["storage_read"]


def test_check_rejects_a_bad_baseline(two_runs, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"components": {"warp_drive": {"value_s": 1}}}))
    assert main(["check", str(two_runs[0]), "--baseline", str(bad)]) == 2
    assert "warp_drive" in capsys.readouterr().err


def test_pytest_plugin_gates_the_same_way(two_runs, tmp_path):
    a, _ = two_runs
    base = tmp_path / "base.json"
    assert main(["check", str(a), "--baseline", str(base), "--write-baseline"]) == 0
    baseline = json.loads(base.read_text())
    baseline["components"]["prefill"]["value_s"] /= 2
    base.write_text(json.dumps(baseline))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "kvscope.analysis.pytest_plugin", "-p", "no:cacheprovider",
         "--kvscope-run", str(a), str(base), "--junitxml", str(tmp_path / "j.xml"), "-q"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 9 passed" in result.stdout
    assert "prefill" in result.stdout


def test_whatif_prints_the_published_comparison(capsys):
    assert main(["whatif"]) == 0
    out = capsys.readouterr().out
    assert "37.97 / 9.30 s" in out and "inconsistent" in out and "Qwen3-Coder-480B" in out


def test_whatif_fits_a_run(two_runs, capsys):
    assert main(["whatif", "--run", str(two_runs[0]), "--read-gbps", "5.23"]) == 0
    out = capsys.readouterr().out
    assert "vs the run's median" in out and "over the run's median: TTFT" in out


def test_outputs_are_read_back_while_current_and_not_after_an_input_changes(tmp_path):
    from kvscope.analysis import load_run, outputs

    run = synthetic.make_run(tmp_path / "run", n_requests=30, seed=3)
    assert outputs.load_current(run) is None  # never analysed
    attribution, summary = outputs.analyze(run, plots=False)
    loaded = outputs.load_current(run)
    assert loaded is not None
    cached_run, cached_attribution, cached_summary = loaded
    pd.testing.assert_frame_equal(cached_attribution, attribution)
    assert cached_summary["groups"] == summary["groups"]
    fresh = load_run(run)
    assert len(cached_run.spans) == len(fresh.spans)
    assert list(cached_run.spans["name"]) == list(fresh.spans["name"])
    assert cached_run.problems == fresh.problems
    rundir.update_manifest(run, "device_ceiling", {"bytes_per_s": 1e9})  # an input changed
    assert outputs.load_current(run) is None
    outputs.analyze(run, plots=False)
    assert outputs.load_current(run) is not None
    requests = rundir.read_table(run, "requests")
    requests.to_parquet(rundir.table_path(run, "requests"), index=False)  # rewritten
    assert outputs.load_current(run) is None


def test_whatif_predicts_one_runs_slowdown_over_another_beside_the_measured_one(two_runs,
                                                                               capsys):
    a, b = (str(run) for run in two_runs)
    assert main(["whatif", "--run", a, "--against", b, "--phase", "cold"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ttft: predicted 1.00x, measured 1.00x, error [+-]0.0%", out)  # one run twice
    assert "storage: predicted 1.00x, measured 1.00x" in out


def test_whatif_names_a_phase_the_run_lacks_in_one_line(two_runs, capsys):
    assert main(["whatif", "--run", str(two_runs[0]), "--phase", "hot"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no request of phase 'hot'" in err and "cold" in err


def test_whatif_against_a_run_without_one_to_fit_is_refused_in_one_line(two_runs, capsys):
    assert main(["whatif", "--against", str(two_runs[1])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "need --run RUN" in err
