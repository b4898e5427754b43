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


def test_tally_follows_the_phase_choice_and_sums_to_the_looked_up_tokens(ledger_run):
    from kvscope.analysis import ledger as analysis_ledger
    from kvscope.dashboards import chunk_callbacks

    runs = data.load_runs([ledger_run[1]])
    (rd,) = runs.values()
    for phase in (data.COLD, "warm", data.ALL):
        rows = data.chunk_ledger_of(runs, [rd.label], phase)
        tally = data.chunk_tally_of(runs, [rd.label], phase)
        hits = tally[tally["outcome"].str.startswith("hit: ")]
        misses = tally[tally["outcome"].str.startswith("miss: ")]
        assert tally["tokens"].sum() == rows["tokens"].sum() > 0
        assert hits["share"].sum() == pytest.approx(hits["tokens"].sum() / rows["tokens"].sum())
        assert misses["share"].sum() == pytest.approx(1.0)
        rate = rd.summary["chunk_ledger"]["prefill_ns_per_token"]
        assert misses["ttft_cost_s"].tolist() == pytest.approx(
            (misses["tokens"] * rate / 1e9).tolist())
    whole = analysis_ledger.tally(rd.chunk_ledger, rate)
    assert whole["misses"] == rd.summary["chunk_ledger"]["misses"]  # the run's own summary
    shown, fig = chunk_callbacks.update_chunk_views(runs, [rd.label], data.COLD)
    assert "miss: " in str(shown) and any(t.name.startswith("miss: ") for t in fig.data)
    key = rd.attribution["key"].iloc[0]
    strip = chunk_callbacks.update_chunk_strip(runs, key)
    assert data.parse_key(key)[2] in strip.layout.title.text
    assert sum(len(t.x) for t in strip.data) == len(data.chunks_of(runs, key))
    blank = chunk_callbacks.update_chunk_strip(runs, None)
    assert "no chunk ledger" in blank.layout.annotations[0].text
