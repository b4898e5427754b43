"""Synthetic runs with known components: exact recovery through the real files and loader."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope import analysis
from kvscope.analysis import COMPONENTS, STORAGE_PARTS
from kvscope.testkit import synthetic
from kvscope.contract import rundir


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**16), concurrency=st.integers(1, 5),
       reads=st.integers(1, 4), ios=st.integers(1, 12), hit_ratio=st.sampled_from([0.0, 0.5, 1.0]))
def test_every_component_is_recovered_exactly(n, seed, concurrency, reads, ios, hit_ratio):
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic.make_run(Path(tmp) / "run", n_requests=n, seed=seed,
                                  concurrency=concurrency, reads_per_request=reads,
                                  ios_per_request=ios, hit_ratio=hit_ratio)
        run = analysis.load_run(path)
        got = analysis.attribute(run)
        truth = synthetic.expected(path)
    assert run.problems == []
    assert list(got["request_id"]) == list(truth["request_id"])
    for column in truth.columns.drop("request_id"):
        assert (got[column].astype("int64").to_numpy() == truth[column].to_numpy()).all(), column
    assert not got["partial"].any() and (got["diagnostics"] == "").all()


def test_components_sum_exactly_and_hidden_time_is_kept(synthetic_run):
    got = analysis.attribute(analysis.load_run(synthetic_run))
    parts = got[[f"{c}_ns" for c in COMPONENTS]].sum(axis=1)
    storage = got[[f"{c}_ns" for c in STORAGE_PARTS]].sum(axis=1)
    assert (parts == got["ttft_ns"]).all() and (storage == got["storage_read_ns"]).all()
    hits = got["read_bytes"] > 0
    assert (got.loc[hits, "hidden_queueing_ns"] > 0).mean() > 0.5  # lookups inside the queue
    assert got["hidden_storage_read_ns"].sum() > 0 and got["hidden_transfer_ns"].sum() > 0
    assert (got.loc[~hits, ["storage_read_ns", "transfer_ns"]] == 0).all().all()


def test_synthetic_run_is_schema_valid_and_ttft_matches_the_requests_table(synthetic_run):
    assert rundir.validate(synthetic_run) == []
    requests = pd.read_parquet(synthetic_run / "requests.parquet")
    got = analysis.attribute(analysis.load_run(synthetic_run))
    assert np.allclose(got["ttft_ns"].astype("int64") / 1e9, requests["ttft_s"], rtol=0, atol=1e-9)
    assert set(got["phase"]) == {"warm", "cold"}


def test_loaded_spans_are_on_the_monotonic_clock_with_request_ids(synthetic_run):
    run = analysis.load_run(synthetic_run)
    assert list(run.spans.columns) == ["trace_id", "span_id", "parent_span_id", "name", "start_ns",
                                       "end_ns", "request_id", "attributes", "service", "pid"]
    first = run.requests.set_index("request_id")["arrival_ns"]
    root = run.spans[run.spans["name"] == "kvscope.client.request"].set_index("request_id")
    assert (root["start_ns"] == first[root.index]).all()
    assert run.spans["trace_id"].str.fullmatch("[0-9a-f]{32}").all()
    assert run.spans["span_id"].str.fullmatch("[0-9a-f]{16}").all()
    assert len(run.nvme_io) == len(run.block_io) > 0
    lanes = run.spans.groupby("pid")["request_id"].nunique()  # one vLLM process per lane
    assert set(run.spans["service"]) == {"kvscope-synthetic"} and len(lanes) == 4


def test_direct_encoder_writes_the_sdk_encoders_documents(tmp_path):
    documents = {}
    for encoder in ("sdk", "direct"):
        path = synthetic.make_run(tmp_path / encoder, n_requests=120, seed=5, ledger=True,
                                  spans_per_file=300, encoder=encoder)
        documents[encoder] = [json.loads(f.read_text())
                              for f in sorted((path / "spans").glob("*.json"))]
    assert len(documents["sdk"]) > 1 and documents["direct"] == documents["sdk"]


def test_label_columns_are_categoricals_that_analyse_as_their_strings(synthetic_run, tmp_path):
    """block_io's and queue_depth's phase, device, op... come as categoricals (a code per I/O,
    not a string): compared, sorted and grouped, they give the attribution and summary the
    strings give. A second disk whose rows come first but whose name sorts last tells sorted
    categories from ones in order of appearance."""
    run = Path(shutil.copytree(synthetic_run, tmp_path / "run"))
    for name in ("block_io", "queue_depth"):
        table = pd.read_parquet(rundir.table_path(run, name))
        table.loc[: len(table) // 3, "device"] = "zz0"
        table.to_parquet(rundir.table_path(run, name), index=False)
    loaded = analysis.load_run(run)
    for name in ("block_io", "queue_depth"):
        frame = getattr(loaded, name)
        assert all(isinstance(frame[c].dtype, pd.CategoricalDtype)
                   for c in rundir.TABLES[name].labels), name
        assert list(frame["device"].cat.categories) == ["vda", "zz0"]
    plain = analysis.load_run(run)
    plain.block_io, plain.queue_depth = (pd.read_parquet(rundir.table_path(run, name))
                                         for name in ("block_io", "queue_depth"))
    got, want = analysis.attribute(loaded), analysis.attribute(plain)
    pd.testing.assert_frame_equal(got, want)
    summary = analysis.summarize(loaded, got)
    assert [d["device"] for d in summary["queue_depth"]] == ["vda", "zz0"]
    assert summary["read_path"] and summary["littles_law"]
    assert json.dumps(summary) == json.dumps(analysis.summarize(plain, want))
    typed = analysis.load_run(run, typed=True)  # what attribution reads of block_io only
    assert list(typed.block_io.columns) == list(rundir.BLOCK_IO_ANALYSIS_COLUMNS)
    pd.testing.assert_frame_equal(analysis.attribute(typed), got)
