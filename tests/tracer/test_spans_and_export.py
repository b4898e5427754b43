"""Request ids, W3C context helpers, and the Perfetto / merged-OTLP exports."""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace
from hypothesis import given
from hypothesis import strategies as st

from kvscope.contract.env import ENV_CLOCK_OFFSET, ENV_SPANS_DIR
from kvscope.analysis import load_run
from kvscope.testkit.synthetic import make_run
from kvscope.cli import main
from kvscope.analysis.otlp import read_span_files
from kvscope.tracer import async_reads, pipeline, runtime
from kvscope.contract import semconv
from kvscope.exports.perfetto import assign_lanes, chrome_trace
from kvscope.tracer.spans import (RequestTrace, client_request_id, context_from_headers,
                                  headers_from_context, remote_parent)


@pytest.mark.parametrize(("vllm_id", "client_id"), [
    pytest.param("cmpl-run1-cold-3-0-1a2b3c4d", "run1-cold-3", id="completions"),
    pytest.param("chatcmpl-abc-def-0123abcd", "abc-def", id="chat"),
    pytest.param("myid-deadbeef", "myid", id="bare"),
    pytest.param("no-suffix", "no-suffix", id="unparsed"),
])
def test_client_request_id_from_vllm_id(vllm_id, client_id):
    assert client_request_id(vllm_id) == client_id


LOWER, HEX = "0123456789abcdef", "0123456789abcdefABCDEF"


def _hex_ids(size: int) -> st.SearchStrategy[str]:
    """Mostly well-formed ids, some all-zero, some of another length or case."""
    return st.one_of(st.text(LOWER, min_size=size, max_size=size), st.just("0" * size),
                     st.text(HEX, min_size=size - 1, max_size=size + 1))


@given(st.sampled_from(["00", "01", "ff", "0"]), _hex_ids(32), _hex_ids(16),
       st.sampled_from(["00", "01", "03", "1"]),
       st.sampled_from([None, "", "k=v", "k=v,bad entry"]))
def test_the_fast_traceparent_reader_agrees_with_the_propagator(version, trace_id, span_id,
                                                                 flags, state):
    headers = {"traceparent": f"{version}-{trace_id}-{span_id}-{flags}"}
    if state is not None:
        headers["tracestate"] = state
    expected = context_from_headers(headers)
    got = remote_parent(headers)
    if expected is None:
        assert got is None
        return
    want = trace.get_current_span(expected).get_span_context()
    assert got is not None
    assert (got.trace_id, got.span_id, got.trace_flags, got.is_remote, got.trace_state) == (
        want.trace_id, want.span_id, want.trace_flags, want.is_remote, want.trace_state)


def test_traceparent_round_trip_and_invalid_headers():
    header = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    context = context_from_headers({"traceparent": header})
    assert headers_from_context(context)["traceparent"] == header
    assert context_from_headers({"traceparent": "garbage"}) is None
    assert context_from_headers(None) is None


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 300)), max_size=40))
def test_lanes_hold_only_nested_or_disjoint_intervals(pairs):
    starts = [s for s, _ in pairs]
    ends = [s + d for s, d in pairs]
    lanes = assign_lanes(starts, ends)
    for i in range(len(pairs)):
        for j in range(i + 1, len(pairs)):
            if lanes[i] != lanes[j]:
                continue
            a, b = (starts[i], ends[i]), (starts[j], ends[j])
            nested = (a[0] <= b[0] and b[1] <= a[1]) or (b[0] <= a[0] and a[1] <= b[1])
            disjoint = a[1] <= b[0] or b[1] <= a[0]
            assert nested or disjoint, (a, b)


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run") / "run", n_requests=6, seed=3)


def _perfetto_ns(start_us: float, dur_us: float = 0.0) -> tuple[int, int]:
    """(start, end) in ns as Perfetto's JSON importer reads a trace event's µs: each of ts and
    dur x 1000, rounded to the nearest ns."""
    start = round(start_us * 1000)
    return start, start + round(dur_us * 1000)


def test_perfetto_reads_are_async_pairs_and_complete_events_nest(synthetic_run):
    spans = load_run(synthetic_run).spans
    events = chrome_trace(spans)["traceEvents"]
    reads = spans[spans["name"] == semconv.SPAN_STORAGE_READ]
    begins = [e for e in events if e["ph"] == "b"]
    assert len(begins) == len(reads) == len([e for e in events if e["ph"] == "e"])
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(spans) - len(reads)
    by_thread: dict = {}
    for e in complete:  # in whole ns, as Perfetto reads them (float sums would not be exact)
        by_thread.setdefault((e["pid"], e["tid"]), []).append(_perfetto_ns(e["ts"], e["dur"]))
    for intervals in by_thread.values():
        intervals.sort(key=lambda iv: (iv[0], -iv[1]))
        stack: list = []
        for start, end in intervals:
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1]
            stack.append(end)
    counters = [e for e in events if e["ph"] == "C"]
    assert counters[-1]["args"] == {"reads": 0, "bytes": 0}
    assert max(c["args"]["reads"] for c in counters) >= 1


def test_export_commands_write_files_and_refuse_a_run_without_spans(synthetic_run, tmp_path,
                                                                    capsys):
    assert main(["export", "perfetto", str(synthetic_run), "-o", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    assert main(["export", "otlp", str(synthetic_run), "-o", str(tmp_path / "o.json")]) == 0
    merged = json.loads((tmp_path / "o.json").read_text())
    count = sum(len(ss["spans"]) for rs in merged["resourceSpans"] for ss in rs["scopeSpans"])
    assert count == len(load_run(synthetic_run).spans)
    empty = tmp_path / "empty"
    (empty / "spans").mkdir(parents=True)
    assert main(["export", "otlp", str(empty)]) == 2
    assert "has no span files" in capsys.readouterr().err


def test_async_loading_reads_wait_for_their_request_and_are_bounded(tmp_path, monkeypatch):
    """kvscope.tracer.async_reads: held per lookup id (vLLM's request id) until that request's load."""
    monkeypatch.setenv(ENV_SPANS_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_CLOCK_OFFSET, "0")
    monkeypatch.setattr(runtime, "_state", {})  # a runtime of this test's own
    monkeypatch.setattr(async_reads, "LIMIT", 2)
    ids = [f"cmpl-r{i}-0-0123abcd" for i in range(3)]
    for i, vllm_id in enumerate(ids):
        async_reads.add(vllm_id, 1_000 + i, 5_000 + i, {semconv.READ_CHUNKS: i})
    assert async_reads.held() == 2, "the oldest lookup is dropped beyond the limit"

    parent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    for vllm_id in ids:
        async_reads.flush(RequestTrace.from_headers(parent, vllm_id))
    assert async_reads.held() == 0
    runtime.reset()  # the link closes: the exporter process exports the rest and exits

    spans, _ = read_span_files(sorted(tmp_path.glob("*.json")), offset_ns=0)
    assert sorted(zip(spans["request_id"], spans["start_ns"], spans["end_ns"])) == [
        ("r1", 1_001, 5_001), ("r2", 1_002, 5_002)]
    assert set(spans["name"]) == {semconv.SPAN_STORAGE_READ}
    assert set(spans["parent_span_id"]) == {"b7ad6b7169203331"}


@pytest.mark.parametrize(("target", "says"), [
    pytest.param("missing/x.json", "its directory", id="missing-directory"),
    pytest.param(".", "is a directory; name a file in it", id="a-directory"),
])
@pytest.mark.parametrize("fmt", ["otlp", "perfetto"])
def test_export_to_an_output_it_cannot_write_is_one_line(synthetic_run, tmp_path, capsys,
                                                        monkeypatch, fmt, target, says):
    monkeypatch.chdir(tmp_path)
    assert main(["export", fmt, str(synthetic_run), "-o", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvscope export: error: -o {target}") and says in err, err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_perfetto_keeps_every_child_within_its_parent_at_epoch_times(synthetic_run):
    """An imported run's spans are epoch ns (clock offset 0). As µs doubles of the epoch they
    keep only about 0.25 µs, so a child ending a few ns before its parent ended after it."""
    spans = load_run(synthetic_run).spans
    shift = 1_796_011_181_952_360_082 - int(spans["start_ns"].min())
    spans = spans.assign(start_ns=spans["start_ns"] + shift, end_ns=spans["end_ns"] + shift)
    original_end = spans.set_index("span_id")["end_ns"]
    child = spans["parent_span_id"].isin(original_end.index)
    spans.loc[child, "end_ns"] = spans.loc[child, "parent_span_id"].map(original_end) - 3
    end_of = spans.set_index("span_id")["end_ns"]
    pairs = spans[child & (spans["start_ns"] <= spans["end_ns"])]
    assert len(pairs) > len(spans) // 2
    assert (pairs["end_ns"] < pairs["parent_span_id"].map(end_of)).all()
    old = {s.span_id: _perfetto_ns(s.start_ns / 1e3, (s.end_ns - s.start_ns) / 1e3)
           for s in spans.itertuples()}
    assert any(old[c.span_id][1] > old[c.parent_span_id][1] for c in pairs.itertuples()), \
        "the old conversion (epoch µs as doubles) mis-nests some child"

    trace = json.loads(json.dumps(chrome_trace(spans)))
    zero = trace["otherData"]["time_zero_ns"]
    times: dict[str, tuple[int, int]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            times[event["args"]["span_id"]] = _perfetto_ns(event["ts"], event["dur"])
        elif event["ph"] in "be":
            begun = times.get(event["id"][2:], (0, 0))
            at = _perfetto_ns(event["ts"])[0]
            times[event["id"][2:]] = (at, begun[1]) if event["ph"] == "b" else (begun[0], at)
    for span in spans.itertuples():
        assert times[span.span_id] == (span.start_ns - zero, span.end_ns - zero), span
    for c in pairs.itertuples():
        parent = times[c.parent_span_id]
        assert parent[0] <= times[c.span_id][0] and times[c.span_id][1] <= parent[1], c
