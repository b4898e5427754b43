"""Bad input gives diagnostics and flagged partial rows: never a crash, never a silent zero."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from kvscope import analysis
from kvscope.testkit import synthetic


@pytest.fixture
def run_copy(synthetic_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(synthetic_run, tmp_path / "run"))


def _analyse(path: Path) -> tuple[analysis.Run, pd.DataFrame, dict]:
    run = analysis.load_run(path)
    frame = analysis.attribute(run)
    return run, frame, analysis.summarize(run, frame)


def _ids(summary: dict) -> set[str]:
    return {f["id"] for f in summary["findings"]}


def test_missing_spans_flag_every_request_and_say_why(run_copy):
    shutil.rmtree(run_copy / "spans")
    run, frame, summary = _analyse(run_copy)
    assert any("no span files" in p for p in run.problems)
    assert frame["partial"].all()
    assert frame["diagnostics"].str.contains("no component spans").all()
    assert (frame["other_ns"] == frame["ttft_ns"]).all()
    assert summary["groups"] == [] and "partial" in _ids(summary)


def test_unmatched_request_ids_on_both_sides(run_copy):
    requests = pd.read_parquet(run_copy / "requests.parquet")
    requests.loc[:4, "request_id"] = [f"ghost-{i}" for i in range(5)]
    requests.to_parquet(run_copy / "requests.parquet", index=False)
    run, frame, summary = _analyse(run_copy)
    ghosts = frame["request_id"].str.startswith("ghost")
    assert frame.loc[ghosts, "partial"].all() and not frame.loc[~ghosts, "partial"].any()
    assert "unmatched-spans" in _ids(summary)


def test_skewed_clock_offset_is_diagnosed_and_clipped(run_copy):
    manifest = json.loads((run_copy / "manifest.json").read_text())
    manifest["clock"]["offset_ns"] -= 3_000_000_000  # spans land 3 s late
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    _, frame, _ = _analyse(run_copy)
    assert frame["partial"].all()
    assert frame["diagnostics"].str.contains("outside .arrival, first token.", regex=True).all()
    parts = frame[[f"{c}_ns" for c in analysis.COMPONENTS]].sum(axis=1)
    assert (parts == frame["ttft_ns"]).all()


def test_exact_duplicate_span_files_change_nothing(run_copy):
    first = sorted((run_copy / "spans").glob("*.json"))[0]
    shutil.copy(first, run_copy / "spans" / "again.json")
    run, frame, _ = _analyse(run_copy)
    assert any("exact copies" in p for p in run.problems)
    truth = synthetic.expected(run_copy)
    assert (frame["storage_read_ns"].astype("int64") == truth["storage_read_ns"]).all()
    assert not frame["partial"].any()


def test_clashing_span_ids_mark_their_requests_partial(run_copy):
    path = sorted((run_copy / "spans").glob("*.json"))[0]
    doc = json.loads(path.read_text())
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    clash = dict(spans[1], startTimeUnixNano=str(int(spans[1]["startTimeUnixNano"]) + 5))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"].append(clash)
    path.write_text(json.dumps(doc))
    run, frame, _ = _analyse(run_copy)
    rid = next(a["value"]["stringValue"] for a in clash["attributes"]
               if a["key"] == "kvscope.request_id")
    row = frame.set_index("request_id").loc[rid]
    assert row["partial"] and "reuse another span's id" in row["diagnostics"]
    assert frame["partial"].sum() == 1


def test_empty_tables_give_empty_results_and_a_finding(tmp_path):
    path = synthetic.make_run(tmp_path / "empty", n_requests=0, seed=1)
    run, frame, summary = _analyse(path)
    assert frame.empty and list(frame.columns) == list(analysis.COLUMNS)
    assert "no-requests" in _ids(summary)


def test_failed_requests_get_no_numbers_and_a_reason(run_copy):
    requests = pd.read_parquet(run_copy / "requests.parquet")
    requests.loc[3, ["status", "error", "first_token_ns"]] = ["error", "HTTP 500", -1]
    requests.to_parquet(run_copy / "requests.parquet", index=False)
    _, frame, summary = _analyse(run_copy)
    row = frame.iloc[3]
    assert pd.isna(row["ttft_ns"]) and pd.isna(row["storage_read_ns"]) and row["partial"]
    assert "request failed (HTTP 500)" in row["diagnostics"]
    assert summary["requests"]["failed"] == 1


def test_broken_span_file_is_skipped_and_named(run_copy):
    (run_copy / "spans" / "broken.json").write_text("{not json")
    run, frame, _ = _analyse(run_copy)
    assert any("broken.json" in p for p in run.problems)
    assert not frame["partial"].any()


def test_missing_probe_tables_leave_storage_unsplit_but_say_so(run_copy):
    (run_copy / "block_io.parquet").unlink()
    (run_copy / "queue_depth.parquet").unlink()
    run, frame, summary = _analyse(run_copy)
    assert any("block_io.parquet is missing" in p for p in run.problems)
    assert (frame["storage_software_ns"] == frame["storage_read_ns"]).all()
    assert summary["queue_depth"] == [] and summary["littles_law"] == []


def test_reads_without_reader_tids_are_partial_when_block_io_exists(run_copy):
    for path in (run_copy / "spans").glob("*.json"):
        path.write_text(path.read_text().replace("kvscope.storage.reader_tids", "x.tids"))
    _, frame, _ = _analyse(run_copy)
    hits = frame["read_bytes"] > 0
    assert frame.loc[hits, "partial"].all() and not frame.loc[~hits, "partial"].any()
    assert frame.loc[hits, "diagnostics"].str.contains("carry neither chunk extents nor kvscope.storage.reader_tids").all()


def test_missing_manifest_and_run_directory(run_copy, tmp_path):
    (run_copy / "manifest.json").unlink()
    run, frame, _ = _analyse(run_copy)
    assert any("manifest.json is missing" in p for p in run.problems)
    assert frame["partial"].all()  # no clock offset: spans cannot line up
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        analysis.load_run(tmp_path / "nowhere")


def test_base64_ids_and_spans_without_request_id_still_join(run_copy):
    import base64
    path = sorted((run_copy / "spans").glob("*.json"))[0]
    doc = json.loads(path.read_text())
    for span in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for key in ("traceId", "spanId"):
            span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
        if span["name"] == "kvscope.prefill":
            span["attributes"] = [a for a in span["attributes"] if a["key"] != "kvscope.request_id"]
    path.write_text(json.dumps(doc))
    run, frame, _ = _analyse(run_copy)
    assert run.spans["trace_id"].str.fullmatch("[0-9a-f]{32}").all()
    truth = synthetic.expected(run_copy)
    assert (frame["prefill_ns"].astype("int64") == truth["prefill_ns"]).all()


def _manifest_with(path: Path, **changes) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        into = manifest
        for key in parents:
            into = into[key]
        into[last] = value
    (path / "manifest.json").write_text(json.dumps(manifest))


def _retyped(path: Path, column: str, dtype) -> None:
    table = pd.read_parquet(path / "requests.parquet")
    table[column] = table[column].astype(dtype)
    table.to_parquet(path / "requests.parquet", index=False)


@pytest.mark.parametrize(("tamper", "named"), [
    pytest.param(lambda p: (p / "manifest.json").write_text("[4]"),
                 "manifest.json holds a JSON list, not an object", id="manifest-a-list"),
    pytest.param(lambda p: _manifest_with(p, clock__offset_ns=1e30),
                 "manifest.json: field clock.offset_ns: 1e+30", id="offset-1e30"),
    pytest.param(lambda p: _manifest_with(p, clock=[1]),
                 "manifest.json: field clock: [1] is not of type 'object'", id="clock-a-list"),
    pytest.param(lambda p: _manifest_with(p, phases="all"),
                 "manifest.json: field phases: 'all' is not of type 'array'", id="phases-text"),
    pytest.param(lambda p: (p / "requests.parquet").write_bytes(b"PAR1garbagePAR1"),
                 "requests.parquet: not a readable parquet file", id="garbage-parquet"),
    pytest.param(lambda p: _retyped(p, "ttft_s", str),
                 "requests.parquet: column ttft_s is large_string, expected double",
                 id="wrong-column-type"),
    pytest.param(lambda p: (p / "manifest.json").write_text("[" * 100_000 + "]" * 100_000),
                 "manifest.json is nested too deeply", id="manifest-deep"),
])
def test_a_tampered_run_is_refused_in_one_line_naming_file_and_field(run_copy, capsys, tamper,
                                                                     named):
    """Issue 19: each of these was a traceback (or, for column types, a table used anyway)."""
    from kvscope.cli import main

    tamper(run_copy)
    assert main(["analyze", str(run_copy), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and str(run_copy) in err, err
    assert not (run_copy / "summary.json").exists()
