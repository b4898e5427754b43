"""Bad input gives diagnostics and flagged partial rows: never a crash, never a silent zero."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
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


def _first_span_file(run: Path) -> Path:
    return sorted((run / "spans").glob("*.json"))[0]


def _with_span(run: Path, **span: object) -> None:
    """Add one span (the first span's ids and times unless given) to the run's first file."""
    path = _first_span_file(run)
    doc = json.loads(path.read_text())
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans.append({**spans[0], "spanId": "fe" * 8, **span})
    path.write_text(json.dumps(doc))


def _server_span_with_ttft(run: Path, ttft: object) -> None:
    _with_span(run, traceId="ab" * 16, name="kvscope.server.request", attributes=[
        {"key": "kvscope.request_id", "value": {"stringValue": "server-only"}},
        {"key": "gen_ai.latency.time_to_first_token", "value": {"doubleValue": ttft}}])


@pytest.mark.parametrize(("tamper", "named"), [
    pytest.param(lambda p: _server_span_with_ttft(p, "NaN"),
                 "synthetic-0000.json: span 'kvscope.server.request': "
                 "gen_ai.latency.time_to_first_token is nan", id="server-ttft-nan"),
    pytest.param(lambda p: _server_span_with_ttft(p, "Infinity"),
                 "gen_ai.latency.time_to_first_token is inf", id="server-ttft-infinity"),
    pytest.param(lambda p: _server_span_with_ttft(p, 1e300),
                 "gen_ai.latency.time_to_first_token is 1e+300", id="server-ttft-1e300"),
    pytest.param(lambda p: _with_span(p, endTimeUnixNano=str(2**64 - 1)),
                 "endTimeUnixNano: 18446744073709551615 is later than kvscope's times reach",
                 id="end-time-past-int64"),
])
def test_span_values_analysis_cannot_compute_with_are_refused_in_one_line(run_copy, capsys,
                                                                         tamper, named):
    """Issue 30: each was a traceback (ValueError, OverflowError) from the span table."""
    from kvscope.cli import main

    tamper(run_copy)
    before = sorted(p.name for p in run_copy.iterdir())
    assert main(["analyze", str(run_copy), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and str(run_copy) in err, err
    assert sorted(p.name for p in run_copy.iterdir()) == before  # nothing written


def test_a_span_in_a_trace_where_no_span_names_its_request_is_left_out(run_copy):
    """Issue 30: the request-id fill of such a trace was an ArrowTypeError (an untyped column)."""
    _with_span(run_copy, traceId="ab" * 16, attributes=[])
    run, frame, _ = _analyse(run_copy)
    assert any("1 spans carry no kvscope.request_id" in p for p in run.problems)
    assert "ab" * 16 not in set(run.spans["trace_id"])
    truth = synthetic.expected(run_copy)
    assert (frame["storage_read_ns"].astype("int64") == truth["storage_read_ns"]).all()


MEMORY_CAP = 4 << 30  # the address space a child kvscope gets here: far below /dev/zero's


def _kvscope(*argv: str) -> subprocess.CompletedProcess:
    """The real `kvscope` command in a child process of at most MEMORY_CAP address space. One
    that waits on a FIFO is killed after two minutes (TimeoutExpired fails the test)."""
    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    return subprocess.run([sys.executable, "-m", "kvscope.cli", *argv], capture_output=True,
                          text=True, timeout=120, preexec_fn=cap_memory)


def _replaced(path: Path, plant) -> None:
    path.unlink(missing_ok=True)
    plant(path)


def _link_to_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _tree(run: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(run)), p.lstat().st_mtime_ns) for p in run.rglob("*"))


@pytest.mark.parametrize(("file", "plant"), [
    pytest.param("spans/zero.json", _link_to_dev_zero, id="span-file-link-to-dev-zero"),
    pytest.param("spans/fifo.json", os.mkfifo, id="span-file-fifo"),
    pytest.param("spans/loop.json", lambda p: p.symlink_to(p.name), id="span-file-link-loop"),
    pytest.param("manifest.json", os.mkfifo, id="manifest-fifo"),
    pytest.param("requests.parquet", os.mkfifo, id="requests-fifo"),
    pytest.param("requests.parquet", _link_to_dev_zero, id="requests-link-to-dev-zero"),
])
@pytest.mark.parametrize("command", ["analyze", "dashboard", "export"])
def test_a_file_of_a_run_that_is_no_regular_file_is_refused_in_one_line(run_copy, tmp_path,
                                                                       free_port, file, plant,
                                                                       command):
    """Issue 30: a span file linked to /dev/zero was a MemoryError; a FIFO span file or
    manifest hung analyze and the dashboard. Now each is refused before it is opened."""
    _replaced(run_copy / file, plant)
    before = _tree(run_copy)
    argv = {"analyze": ["analyze", str(run_copy), "--no-plots"],
            "dashboard": ["dashboard", str(run_copy), "--port", str(free_port)],
            "export": ["export", "perfetto", str(run_copy), "-o", str(tmp_path / "out.json")]}
    done = _kvscope(*argv[command])
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and str(run_copy / file) in done.stderr, done.stderr
    assert "regular file" in done.stderr or "symbolic link" in done.stderr, done.stderr
    assert _tree(run_copy) == before and not (tmp_path / "out.json").exists()


@pytest.fixture(scope="module")
def analysed_run(synthetic_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic run with its outputs (read-only: tests that edit it copy it; a copy keeps
    the files' times, so its outputs stay current)."""
    from kvscope.analysis import outputs

    run = Path(shutil.copytree(synthetic_run, tmp_path_factory.mktemp("analysed") / "run"))
    outputs.analyze(run, plots=False)
    return run


def _edit_summary(run: Path, **changes: object) -> None:
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, **changes}))


def _edit_table(path: Path, edit) -> None:
    table = pd.read_parquet(path)
    edit(table).to_parquet(path, index=False)


def _edit_span_table_meta(run: Path, key: str, value: str) -> None:
    """spans.parquet again with footer metadata `key` set to the text `value`."""
    import pyarrow.parquet as pq

    path = run / "spans.parquet"
    parquet = pq.ParquetFile(path)
    meta = {k.decode(): v.decode() for k, v in parquet.metadata.metadata.items()
            if k != b"ARROW:schema"}
    table = parquet.read().replace_schema_metadata(None)
    with pq.ParquetWriter(path, table.schema) as writer:
        writer.write_table(table)
        writer.add_key_value_metadata({**meta, key: value})


DEEP = "[" * 100_000 + "]" * 100_000
FINGERPRINT, NOTES, PROBLEMS = ("kvscope.spans.fingerprint", "kvscope.spans.notes",
                                "kvscope.spans.problems")


@pytest.mark.parametrize("tamper", [
    pytest.param(lambda p: _edit_summary(p, groups=[1]), id="summary-groups-of-numbers"),
    pytest.param(lambda p: _edit_summary(p, requests=[]), id="summary-requests-a-list"),
    pytest.param(lambda p: _edit_summary(p, findings=["x"]), id="summary-findings-text"),
    pytest.param(lambda p: (p / "summary.json").write_text(DEEP), id="summary-deep"),
    pytest.param(lambda p: (p / "summary.json").write_bytes(b"\xff\xfe{"),
                 id="summary-garbage-bytes"),
    pytest.param(lambda p: _replaced(p / "summary.json", os.mkfifo), id="summary-fifo"),
    pytest.param(lambda p: (p / "attribution.parquet").write_bytes(b"PAR1garbagePAR1"),
                 id="attribution-garbage"),
    pytest.param(lambda p: _edit_table(p / "attribution.parquet",
                                       lambda t: t.drop(columns="ttft_ns")),
                 id="attribution-missing-column"),
    pytest.param(lambda p: _edit_table(p / "attribution.parquet",
                                       lambda t: t.astype({"ttft_ns": str})),
                 id="attribution-wrong-type"),
    pytest.param(lambda p: (p / "chunk_ledger.parquet").write_bytes(b"\x00" * 64),
                 id="ledger-garbage"),
    pytest.param(lambda p: _edit_table(p / "chunk_ledger.parquet",
                                       lambda t: t.drop(columns="request_id")),
                 id="ledger-missing-column"),
    pytest.param(lambda p: _edit_span_table_meta(p, FINGERPRINT, "{bad"),
                 id="span-table-fingerprint-not-json"),
    pytest.param(lambda p: _edit_span_table_meta(p, FINGERPRINT, DEEP),
                 id="span-table-fingerprint-deep"),
    pytest.param(lambda p: _edit_span_table_meta(p, NOTES, "[1]"), id="span-table-notes-a-list"),
    pytest.param(lambda p: _edit_span_table_meta(p, PROBLEMS, "5"),
                 id="span-table-problems-a-number"),
    pytest.param(lambda p: _edit_table(p / "spans.parquet",
                                       lambda t: t.astype({"start_ns": "float64"})),
                 id="span-table-wrong-type"),
    pytest.param(lambda p: (p / "spans.parquet").write_bytes(b"PAR1" * 8),
                 id="span-table-garbage"),
])
def test_a_damaged_or_edited_output_is_made_again_as_a_stale_one_is(analysed_run, tmp_path,
                                                                   capsys, tamper):
    """Issue 30: outputs are outside inputs_fingerprint, so an edited copy was read as current
    and gave tracebacks (JSONDecodeError, RecursionError, KeyError, AttributeError) in analyze,
    the dashboard and compare. An output is a cache of the inputs: now one of the wrong shape
    is taken for stale and made again, as a missing one is."""
    from kvscope.analysis import spantable
    from kvscope.analysis.run import clock_offset_ns
    from kvscope.cli import main
    from kvscope.dashboards import callbacks, data

    run = Path(shutil.copytree(analysed_run, tmp_path / "run"))
    tamper(run)
    loaded = data.load_runs([run])
    callbacks.update_summary_views(loaded, ["run"], None)
    data.chunk_tally_of(loaded, ["run"])
    truth = data.load_runs([analysed_run])
    assert sorted(zip(loaded["run"].attribution["key"], loaded["run"].attribution["ttft_ns"])) \
        == sorted(zip(truth["run"].attribution["key"], truth["run"].attribution["ttft_ns"]))
    assert main(["compare", str(run), str(analysed_run), "--boot", "10"]) == 0
    assert main(["export", "perfetto", str(run), "-o", str(tmp_path / "trace.json")]) == 0
    assert main(["analyze", str(run), "--no-plots"]) == 0, capsys.readouterr().err
    assert spantable._current(run, clock_offset_ns(run)) is not None  # made again, current
