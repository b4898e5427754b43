"""The chunk ledger in analysis (analysis/ledger.py): exact per-request token columns on a
synthetic run whose chunks are known, per-tier hit rates and miss reasons with their TTFT cost,
the finding when one reason dominates, and a v3 run (no ledger spans) that still loads."""

from __future__ import annotations

import argparse
import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvscope.analysis import ledger, outputs
from kvscope.commands import analyze as analyze_command
from kvscope.contract import chunk_outcomes
from kvscope.contract import rundir
from kvscope.testkit import synthetic

TOKEN_COLUMNS = list(chunk_outcomes.TOKEN_COLUMNS)


@pytest.fixture(scope="module")
def ledger_run(tmp_path_factory):
    path = synthetic.make_run(tmp_path_factory.mktemp("ledger") / "run", n_requests=60, seed=5,
                              ledger=True)
    attribution, summary = outputs.analyze(path, plots=False)
    return path, attribution, summary


def test_attribution_has_exact_tokens_per_tier_and_reason(ledger_run):
    path, attribution, _ = ledger_run
    truth = synthetic.expected(path).set_index("request_id")[TOKEN_COLUMNS]
    got = attribution.set_index("request_id")[TOKEN_COLUMNS]
    pd.testing.assert_frame_equal(got.astype("int64"), truth.loc[got.index], check_dtype=False)
    hits = sum(got[chunk_outcomes.hit_tokens_column(t)] for t in chunk_outcomes.TIERS)
    missed = sum(got[chunk_outcomes.missed_tokens_column(r)] for r in chunk_outcomes.REASONS)
    assert (hits + missed == got["ledger_tokens"]).all()
    assert (got["ledger_tokens"] == synthetic.PROMPT_TOKENS).all()
    assert truth[chunk_outcomes.hit_tokens_column("vllm")].sum() > 0  # the kv.lookup join is exercised


def test_chunk_ledger_table_is_written_with_the_contract_columns(ledger_run):
    path, _, _ = ledger_run
    table = pd.read_parquet(path / rundir.CHUNK_LEDGER.file)
    assert list(table.columns) == rundir.CHUNK_LEDGER.columns
    schema = pq.read_schema(path / rundir.CHUNK_LEDGER.file)
    for field in rundir.CHUNK_LEDGER.schema:
        got = schema.field(field.name).type
        assert got == field.type or (pa.types.is_large_string(got) and field.type == pa.string())
    hits = table[table["tier"] != chunk_outcomes.TIER_NONE]
    assert (hits["reason"] == "").all()  # nothing is reported for a chunk that hit
    misses = table[table["tier"] == chunk_outcomes.TIER_NONE]
    assert set(misses["reason"]) <= set(chunk_outcomes.REASONS) and (misses["reason"] != "").all()
    one = table[table["request_id"] == table["request_id"].iloc[0]]
    assert list(one["chunk_index"]) == list(range(len(one)))  # a strip per request, in order


def test_summary_tiers_reasons_and_ttft_cost(ledger_run):
    path, attribution, summary = ledger_run
    truth = synthetic.expected(path)
    s = summary["chunk_ledger"]
    total = int(truth["ledger_tokens"].sum())
    assert s["tokens"] == total
    for tier in chunk_outcomes.TIERS:
        tokens = int(truth[chunk_outcomes.hit_tokens_column(tier)].sum())
        assert s["tiers"][tier]["tokens"] == tokens
        assert s["tiers"][tier]["hit_rate"] == pytest.approx(tokens / total)
    missed = sum(truth[chunk_outcomes.missed_tokens_column(r)] for r in chunk_outcomes.REASONS)
    computed = missed > 0  # a prefill span with computed tokens: every missed one
    rate = truth.loc[computed, "prefill_ns"].sum() / s["missed_tokens"]
    assert s["prefill_ns_per_token"] == pytest.approx(rate)
    by_reason = {m["reason"]: m for m in s["misses"]}
    for reason in chunk_outcomes.REASONS:
        tokens = int(truth[chunk_outcomes.missed_tokens_column(reason)].sum())
        if not tokens:
            assert reason not in by_reason
            continue
        assert by_reason[reason]["tokens"] == tokens
        assert by_reason[reason]["ttft_cost_s"] == pytest.approx(tokens * rate / 1e9)
    assert [m["tokens"] for m in s["misses"]] == sorted((m["tokens"] for m in s["misses"]),
                                                        reverse=True)
    assert by_reason[chunk_outcomes.EVICTED_DISK]["median_age_s"] == pytest.approx(90.0)
    json.dumps(summary)  # JSON-ready


def test_one_dominant_reason_is_a_finding_and_analyze_prints_the_ledger(tmp_path, monkeypatch,
                                                                         capsys):
    monkeypatch.setattr(synthetic, "MISSES", ((chunk_outcomes.EVICTED_DISK, "capacity 20 GiB"),))
    path = synthetic.make_run(tmp_path / "run", n_requests=20, seed=2, ledger=True)
    assert analyze_command.run(argparse.Namespace(run=str(path), no_plots=False)) == 0
    out = capsys.readouterr().out
    assert "| evicted_disk |" in out and "| disk |" in out
    summary = json.loads((path / outputs.SUMMARY_FILE).read_text())
    found = [f for f in summary["findings"] if f["id"] == "miss-reason"]
    assert len(found) == 1
    assert found[0]["message"].startswith("100 % of missed tokens")
    assert "evicted by the disk capacity (capacity 20 GiB), a median 90.0 s after" in \
        found[0]["message"]
    assert "## Chunk ledger" in (path / "report.md").read_text()


def test_no_finding_without_a_dominant_reason():
    summary = {"missed_tokens": 10, "misses": [
        {"reason": "never_stored", "tokens": 5, "share_of_missed": 0.5, "details": {},
         "median_age_s": None, "ttft_cost_s": None}]}
    assert ledger.finding(summary) is None
    assert ledger.finding(None) is None


def test_a_v3_run_without_ledger_spans_still_loads(tmp_path):
    path = synthetic.make_run(tmp_path / "run", n_requests=8, seed=1)
    manifest = json.loads((path / rundir.MANIFEST).read_text())
    manifest["schema_version"] = 3
    (path / rundir.MANIFEST).write_text(json.dumps(manifest))
    assert rundir.validate(path) == []
    attribution, summary = outputs.analyze(path, plots=False)
    assert (attribution[TOKEN_COLUMNS] == 0).all().all()
    assert summary["chunk_ledger"] is None
    assert pd.read_parquet(path / rundir.CHUNK_LEDGER.file).empty


def test_malformed_ledger_spans_are_skipped():
    from kvscope.contract import semconv
    spans = pd.DataFrame({
        "name": [semconv.SPAN_KV_LEDGER], "request_id": ["r"], "start_ns": [1], "end_ns": [2],
        "attributes": [{semconv.LEDGER_START: [0, 256], semconv.LEDGER_END: [256]}]})
    assert ledger.table(spans).empty
