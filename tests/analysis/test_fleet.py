"""A fleet on Dask: `kvscope analyze --engine dask` over several run directories on a local
cluster gives every run's rows as one in-process pass does, and a summary per server, device,
backend and hour."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from kvscope import analysis
from kvscope.analysis import fleet as fleet_analysis
from kvscope.cli import main
from kvscope.contract import fleet, rundir
from kvscope.testkit import synthetic


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("fleet")
    made = []
    for i, host in enumerate(("node-a", "node-a", "node-b")):
        path = synthetic.make_run(base / f"run{i}", n_requests=150, seed=20 + i,
                                  phases=("warm", "cold"))
        machine = rundir.read_manifest(path)["machine"]
        rundir.update_manifest(path, "machine", {**machine, "hostname": host})
        made.append(path)
    return made


def test_dask_cluster_gives_the_in_process_rows_and_a_fleet_summary(runs, tmp_path, capsys):
    sources = [str(runs[0]), str(runs[1] / "spans.parquet"), str(runs[2])]
    analysis.outputs.attribute_run(runs[1])  # its span table exists: named as the source
    assert main(["analyze", "--engine", "dask", "--workers", "2", "--out",
                 str(tmp_path / "dask"), *sources]) == 0
    assert "node-b" in capsys.readouterr().out
    parts = sorted((tmp_path / "dask" / fleet.PARTS_DIR).glob("*.parquet"))
    on_dask = fleet_analysis.read_parts([str(p) for p in parts])
    fleet_analysis.analyze(sources, tmp_path / "local")  # the same task, in this process
    local = fleet_analysis.read_parts(
        [str(p) for p in sorted((tmp_path / "local" / fleet.PARTS_DIR).glob("*.parquet"))])
    pd.testing.assert_frame_equal(on_dask, local)
    one_pass = pd.concat([analysis.attribute(analysis.load_run(r)) for r in runs],
                         ignore_index=True)
    pd.testing.assert_frame_equal(on_dask.drop(columns=list(fleet.LABELS)), one_pass)
    assert on_dask.groupby("server")["run_id"].nunique().to_dict() == {"node-a": 2, "node-b": 1}
    summary = pd.read_parquet(tmp_path / "dask" / fleet.SUMMARY_FILE)
    servers = summary[summary["by"] == "server"].set_index("value")
    assert servers.loc["node-a", "requests"] == 2 * servers.loc["node-b", "requests"] == 300
    shares = summary[[c for c in summary.columns if c.endswith("_share")]].sum(axis=1)
    assert ((shares - 1).abs() < 1e-9).all()
    assert set(summary["by"]) == set(fleet.GROUPS)
