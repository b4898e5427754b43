"""The dashboard's chunk ledger: the rows analysis made, whether read from the analysis outputs
or analysed at start, with the phase of each request."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest

from kvscope.analysis import ledger, load_run, outputs
from kvscope.dashboards import data


@pytest.fixture(scope="module")
def ledger_run(tmp_path_factory):
    from kvscope.testkit import synthetic

    root = tmp_path_factory.mktemp("ledger")
    raw = synthetic.make_run(root / "raw", n_requests=12, seed=3, phases=("warm", "cold"),
                             ledger=True)
    analysed = root / "analysed"
    shutil.copytree(raw, analysed)
    outputs.analyze(analysed, plots=False)
    return raw, analysed


def test_both_load_paths_give_analysis_ledger_with_phases(ledger_run):
    raw, analysed = ledger_run
    expected = ledger.of_run(load_run(raw))
    assert len(expected) > 0 and set(expected["tier"]) > {"none"}
    assert outputs.load_current(analysed) is not None  # the dashboard reads the parquet there
    phase_of = load_run(raw).requests.set_index("request_id")["phase"]
    for path in (raw, analysed):
        runs = data.load_runs([path])
        (rd,) = runs.values()
        got = rd.chunk_ledger
        pd.testing.assert_frame_equal(
            got.drop(columns=["run", "phase"]).reset_index(drop=True),
            expected.reset_index(drop=True), check_dtype=False)
        assert (got["phase"] == got["request_id"].map(phase_of)).all()
        cold = data.chunk_ledger_of(runs, [rd.label], data.COLD)
        assert len(cold) and set(cold["phase"]) == {"cold"}
        assert len(data.chunk_ledger_of(runs, [rd.label], data.ALL)) == len(got)


def test_a_requests_chunks_in_prompt_order(ledger_run):
    runs = data.load_runs([ledger_run[0]])
    (rd,) = runs.values()
    key = rd.attribution["key"].iloc[-1]
    rows = data.chunks_of(runs, key)
    request_id = data.parse_key(key)[2]
    assert len(rows) == (rd.chunk_ledger["request_id"] == request_id).sum() > 0
    assert rows["chunk_index"].tolist() == sorted(rows["chunk_index"])
    assert (rows["request_id"] == request_id).all()
