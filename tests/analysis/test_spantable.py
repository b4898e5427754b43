"""The columnar span table: the fast reader agrees with protobuf's, the table keeps every
attribute exactly, analysis reads typed columns, and RUN/spans.parquet is a cache that
follows its span files."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest

from kvscope import analysis
from kvscope.analysis import otlp, otlp_fast, outputs, spanstream, spantable
from kvscope.contract import semconv
from kvscope.contract import spantable as spec
from kvscope.testkit import synthetic

LIVE = Path(__file__).parent / "data" / "live-serial-c16"
OFFSET = 123_456


def _document(attributes: list[dict], **span: object) -> dict:
    body = {"traceId": "ab" * 16, "spanId": "cd" * 8, "name": semconv.SPAN_STORAGE_READ,
            "startTimeUnixNano": "2000", "endTimeUnixNano": 3000, "attributes": attributes,
            **span}
    return {"resourceSpans": [{"resource": {"attributes": [
        {"key": "service.name", "value": {"stringValue": "svc"}},
        {"key": "process.pid", "value": {"intValue": "7"}}]},
        "scopeSpans": [{"spans": [body]}]}]}


def _rid(value: str = "r1") -> dict:
    return {"key": semconv.REQUEST_ID, "value": {"stringValue": value}}


@pytest.fixture(scope="module")
def ledger_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic.make_run(tmp_path_factory.mktemp("ledger") / "run", n_requests=60, seed=3,
                              ledger=True, spans_per_file=250)


def test_fast_reader_gives_protobufs_rows_with_the_same_types(ledger_run):
    files = [*sorted((LIVE / "spans").glob("*.json")), *spantable.span_files(ledger_run)]
    for path in files:
        fast = otlp_fast.batch(path.read_bytes(), OFFSET)
        slow, problems = otlp.read_rows(path, OFFSET)
        assert fast is not None and problems == []
        # typed columns compare with their types; the JSON text of the other attributes
        # tells 1 from 1.0 and True
        assert fast.equals(spec.rows_batch(slow)), path.name


@pytest.mark.parametrize("document", [
    _document([_rid()], traceId="q6urq6urq6urq6urq6urqw=="),  # a proto base64 id
    _document([_rid()], start_time_unix_nano="5"),  # protobuf's snake_case spelling
    _document([_rid()], spanId="0" * 16),  # the invalid id: otlp_json refuses the document
    _document([_rid(), {"key": semconv.READ_BYTES, "value": {"stringValue": "7"}}]),
    _document([_rid(), {"key": "k", "value": {"bytesValue": "AAE="}}]),
    _document([_rid(), {"key": "k", "value": {"doubleValue": "NaN"}}]),
    _document([_rid(), {"key": "k", "value": {"intValue": "1e3"}}]),
    _document([_rid(), {"key": "k", "value": {"intValue": "1", "stringValue": "1"}}]),
], ids=["base64-id", "snake-case", "zero-id", "int-as-text", "bytes", "nan-text",
        "exponent-int", "two-values"])
def test_fast_reader_hands_back_what_only_protobuf_reads_for_sure(document, tmp_path):
    text = json.dumps(document).encode()
    assert otlp_fast.batch(text, 0) is None
    path = tmp_path / "doc.json"
    path.write_bytes(text)
    frame = spantable.frame(spantable.build([path], 0))
    slow, problems = otlp.read_rows(path, 0)
    assert len(frame) == len(slow)
    for got, want in zip(frame.itertuples(index=False), slow):
        # bytes values (the tracer writes none) come back as their base64 text
        plain = {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
                 for k, v in want[7].items()}
        assert json.dumps(got.attributes, sort_keys=True) == json.dumps(plain, sort_keys=True)
        assert got.trace_id == want[0]


def test_table_keeps_every_attribute_and_its_type(tmp_path):
    attributes = [_rid(), {"key": semconv.READ_BYTES, "value": {"stringValue": "4096"}},
                  {"key": semconv.READER_TIDS, "value": {"stringValue": "[5, 6]"}},
                  {"key": semconv.GEN_AI_TTFT, "value": {"doubleValue": 1}},
                  {"key": semconv.READ_AHEAD, "value": {"boolValue": True}},
                  {"key": "nested", "value": {"kvlistValue": {"values": [
                      {"key": "x", "value": {"doubleValue": 0.5}}]}}},
                  {"key": "empty", "value": {}}]
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(_document(attributes)))
    table = spantable.build([path], 0)
    [want] = otlp.read_rows(path, 0)[0]
    [got] = spantable.frame(table)["attributes"]
    assert json.dumps(got, sort_keys=True) == json.dumps(want[7], sort_keys=True)
    # a kvscope key a backend kept as text (Jaeger) arrives as its declared type, typed
    typed = spantable.typed_frame(table)
    assert "attributes" not in typed and "trace_id" not in typed
    assert spantable.values(typed, semconv.READ_BYTES) == [4096]
    assert spantable.values(typed, semconv.READER_TIDS) == [[5, 6]]
    assert spantable.values(typed, semconv.GEN_AI_TTFT) == [1.0]


@pytest.mark.parametrize("cached", [False, True])
def test_typed_and_dict_frames_give_the_same_attribution(ledger_run, cached):
    whole = analysis.load_run(ledger_run)
    if cached:  # typed columns read from the file, only those that hold values
        spantable.ensure(ledger_run, analysis.run.clock_offset_ns(ledger_run))
    typed = analysis.load_run(ledger_run, typed=True)
    assert (ledger_run / spantable.FILE).exists() == cached
    assert semconv.LEDGER_TIER in typed.spans and semconv.PREFILL_TOKENS in typed.spans
    assert semconv.GEN_AI_TTFT not in typed.spans  # no span has it
    assert typed.problems == whole.problems and typed.request_notes == whole.request_notes
    pd.testing.assert_frame_equal(typed.requests, whole.requests)
    pd.testing.assert_frame_equal(analysis.attribute(typed), analysis.attribute(whole))
    truth = synthetic.expected(ledger_run)
    got = analysis.attribute(typed)
    assert (got[truth.columns[1:]].astype("int64") == truth[truth.columns[1:]]).all().all()


def test_spans_parquet_is_made_once_and_follows_its_span_files(synthetic_run, tmp_path):
    run = Path(shutil.copytree(synthetic_run, tmp_path / "run"))
    offset = analysis.run.clock_offset_ns(run)
    made = spantable.ensure(run, offset)
    stamp = made.stat().st_mtime_ns
    assert spantable.ensure(run, offset).stat().st_mtime_ns == stamp  # current: not rebuilt
    cached = analysis.load_run(run)
    first = spantable.span_files(run)[0]
    spans = json.loads(first.read_text())
    spans["resourceSpans"] = spans["resourceSpans"][1:]
    first.write_text(json.dumps(spans))
    os.utime(first, ns=(stamp + 10**9, stamp + 10**9))
    fresh = analysis.load_run(run)  # stale: read from the span files again
    assert len(fresh.spans) < len(cached.spans)
    outputs.analyze(run, plots=False)
    assert spantable.ensure(run, offset).stat().st_mtime_ns != stamp
    pd.testing.assert_frame_equal(analysis.load_run(run).spans, fresh.spans)


def _span(trace: str, span: str, end: int, rid: str | None) -> dict:
    return {"traceId": trace * 32, "spanId": span * 16, "name": semconv.SPAN_QUEUE,
            "startTimeUnixNano": "1000", "endTimeUnixNano": str(end),
            "attributes": [_rid(rid)] if rid else []}


@pytest.mark.parametrize("row_group", [2, 1000])
def test_cleaning_works_across_files_and_row_groups(tmp_path, monkeypatch, row_group):
    """Spans are cleaned as the table is written, file by file: a span without a request id
    takes the one its trace gets in a later file, copies and clashing ids are dropped (the
    clash noted on its request), an orphan is left out; the same whatever the row groups."""
    monkeypatch.setattr(spanstream, "ROW_GROUP", row_group)
    first = [_span("1", "a", 2000, None), _span("2", "b", 2000, "r2"), _span("4", "f", 9, "r4")]
    later = [_span("1", "c", 2000, "r1"), _span("2", "b", 2000, "r2"),  # an exact copy
             _span("2", "b", 2500, "r2"), _span("3", "d", 2000, None)]  # a clash, an orphan
    paths = []
    for i, spans in enumerate((first, later)):
        document = _document([])
        document["resourceSpans"][0]["scopeSpans"][0]["spans"] = spans
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(document))
    table = spantable.build(paths, 0)
    assert table["span_id"].to_pylist() == ["a" * 16, "b" * 16, "f" * 16, "c" * 16]
    assert table["request_id"].to_pylist() == ["r1", "r2", "r4", "r1"]
    problems = json.loads(table.schema.metadata[spec.META_PROBLEMS])
    assert [p.split(" spans")[0] for p in problems] == ["1", "1", "1"]
    assert json.loads(table.schema.metadata[spec.META_NOTES]) == {
        "r2": ["1 spans reuse another span's id; the first was kept"]}


def test_files_parsed_in_worker_processes_make_the_same_table(ledger_run, tmp_path,
                                                              monkeypatch):
    """Span files parsed by two spawned workers (what big runs get) give the table, problems
    and notes that parsing them here gives, with a document only protobuf reads and one that
    is no OTLP among them."""
    only_protobuf = tmp_path / "base64.json"
    only_protobuf.write_text(json.dumps(_document([_rid()], traceId="q6urq6urq6urq6urq6urqw==")))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    files = [*spantable.span_files(ledger_run), *sorted((LIVE / "spans").glob("*.json")),
             only_protobuf, broken]
    here = spantable.build(files, OFFSET)
    assert json.loads(here.schema.metadata[spec.META_PROBLEMS])  # the broken file's
    monkeypatch.setattr(spanstream, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(spanstream.parallel, "cores", lambda: 2)
    assert spanstream._workers(files) == 2
    assert spantable.build(files, OFFSET).equals(here, check_metadata=True)
