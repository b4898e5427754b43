"""Batch-aware attribution: time a request waited while its worker served other requests."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.analysis import COMPONENTS, DEFAULT_PRIORITY, STORAGE_PARTS, attribute, load_run, summarize
from kvscope.analysis.attribution import BATCH_PARTS, SPAN_COMPONENT
from kvscope.testkit.memory_runs import memory_run

NAME_OF = {component: name for name, component in SPAN_COMPONENT.items()}
LOAD, STORE = "kvscope.kv.load", "kvscope.kv.store"
WORKER = {NAME_OF["storage_read"], NAME_OF["transfer"], NAME_OF["prefill"], LOAD, STORE}
LIVE = Path(__file__).parent / "data" / "live-serial-c16"


def _span(rid: str, component: str, start: int, end: int, pid: int = 1, **attributes) -> dict:
    name = NAME_OF.get(component, component)
    return {"request_id": rid, "name": name, "start_ns": start, "end_ns": end, "pid": pid,
            "attributes": attributes}


def _load(rid: str, start: int) -> list[dict]:
    """One request's KV load in a serial step: kv.load [s, s+30) = read 19 + transfer 9 + 2."""
    return [_span(rid, LOAD, start, start + 30), _span(rid, "storage_read", start + 1, start + 20),
            _span(rid, "transfer", start + 20, start + 29)]


def _row(frame: pd.DataFrame, rid: str) -> dict[str, int]:
    row = frame.set_index("request_id").loc[rid]
    return {c: int(row[f"{c}_ns"]) for c in ("ttft", *COMPONENTS, *BATCH_PARTS)}


def test_three_requests_loaded_one_after_another_in_one_step():
    requests = [{"request_id": f"r{i}", "arrival_ns": i, "first_token_ns": 135} for i in range(3)]
    spans = [_span(f"r{i}", "queueing", 10, 20) for i in range(3)]
    for i in range(3):
        spans += _load(f"r{i}", 20 + 30 * i) + [_span(f"r{i}", "prefill", 110, 130)]
    got = attribute(memory_run(requests, spans))
    # each waits for the two other loads: 2 x (read 19, transfer 9, kv.load self 2); its own
    # kv.load self time (2), time before the queue (10 - arrival, worker idle) and the 5 after
    # its prefill (the output path, not the worker) stay `other`
    for i in range(3):
        assert _row(got, f"r{i}") == {
            "ttft": 135 - i, "queueing": 10, "kv_lookup": 0, "storage_read": 57, "transfer": 27,
            "prefill": 20, "other": 21 - i, "batch_storage_read": 38, "batch_transfer": 18,
            "batch_prefill": 0, "batch_other": 4}
    assert not got["partial"].any() and (got["diagnostics"] == "").all()


def test_arriving_during_another_requests_step_counts_from_arrival_or_from_scheduling():
    requests = [{"request_id": "a", "arrival_ns": 0, "first_token_ns": 62},
                {"request_id": "b", "arrival_ns": 10, "first_token_ns": 92}]
    spans = [_span("a", "queueing", 0, 5), _span("a", "storage_read", 5, 50),
             _span("a", "prefill", 50, 60), _span("b", "queueing", 60, 61),
             _span("b", "storage_read", 61, 80), _span("b", "prefill", 80, 90)]
    run = memory_run(requests, spans)
    since_arrival = _row(attribute(run), "b")
    assert since_arrival == {"ttft": 82, "queueing": 1, "kv_lookup": 0, "storage_read": 59,
                             "transfer": 0, "prefill": 20, "other": 2, "batch_storage_read": 40,
                             "batch_transfer": 0, "batch_prefill": 10, "batch_other": 0}
    scheduled = _row(attribute(run, batch_from="scheduled"), "b")
    assert scheduled == {**since_arrival, "storage_read": 19, "prefill": 10, "other": 52,
                         "batch_storage_read": 0, "batch_prefill": 0}
    with pytest.raises(ValueError, match="batch_from"):
        attribute(run, batch_from="queued")


def test_own_spans_come_first_and_other_processes_do_not_count():
    requests = [{"request_id": "a", "arrival_ns": 0, "first_token_ns": 120},
                {"request_id": "b", "arrival_ns": 0, "first_token_ns": 120},
                {"request_id": "c", "arrival_ns": 0, "first_token_ns": 120}]
    spans = [_span("a", "storage_read", 0, 100), _span("a", "prefill", 100, 110),
             _span("b", "queueing", 0, 10), _span("b", LOAD, 10, 50),  # own kv.load: b's work
             _span("b", "prefill", 100, 110),
             _span("c", "prefill", 100, 110, pid=2)]  # c runs in another worker process
    got = attribute(memory_run(requests, spans))
    assert _row(got, "b") == {"ttft": 120, "queueing": 10, "kv_lookup": 0,
                               "storage_read": 50, "transfer": 0, "prefill": 10,
                                   "other": 50, "batch_storage_read": 50, "batch_transfer": 0,
                                   "batch_prefill": 0, "batch_other": 0}
    assert _row(got, "c")["other"] == 110 and _row(got, "c")["batch_storage_read"] == 0


@pytest.mark.parametrize("priority, read, transfer", [
    (DEFAULT_PRIORITY, 20, 20),
    (("prefill", "storage_read", "transfer", "kv_lookup", "queueing"), 30, 10)])
def test_overlapping_work_of_several_others_is_a_union_resolved_by_priority(priority, read,
                                                                              transfer):
    requests = [{"request_id": r, "arrival_ns": 0, "first_token_ns": 70} for r in "abc"]
    spans = [_span("a", "storage_read", 10, 40), _span("b", "transfer", 30, 50),
             _span("b", "storage_read", 12, 38),  # under a's read: counted once
             _span("c", "queueing", 0, 10), _span("c", "prefill", 60, 70)]
    row = _row(attribute(memory_run(requests, spans), priority=priority), "c")
    assert (row["batch_storage_read"], row["batch_transfer"], row["other"]) == (read, transfer, 10)


def test_waiting_on_another_requests_read_is_split_by_its_block_io():
    requests = [{"request_id": r, "arrival_ns": 0, "first_token_ns": 60} for r in "ab"]
    spans = [_span("a", "storage_read", 10, 50, **{"kvscope.storage.reader_tids": [7]}),
             _span("b", "queueing", 0, 10), _span("b", "prefill", 50, 60)]
    io = [{"tid": 7, "start_ns": 20, "insert_ns": 20, "issue_ns": 25, "complete_ns": 40}]
    got = attribute(memory_run(requests, spans, io)).set_index("request_id").loc["b"]
    split = [int(got[f"{c}_ns"]) for c in STORAGE_PARTS]
    assert split == [5, 15, 20] and int(got["batch_storage_read_ns"]) == 40 == sum(split)


def test_spans_without_a_process_id_join_no_batch_and_say_so():
    requests = [{"request_id": r, "arrival_ns": 0, "first_token_ns": 60} for r in "ab"]
    spans = [_span("a", "storage_read", 10, 50, pid=-1), _span("b", "queueing", 0, 10),
             _span("b", "prefill", 50, 60, pid=-1)]
    got = attribute(memory_run(requests, spans)).set_index("request_id")
    assert int(got.loc["b", "other_ns"]) == 40 and int(got.loc["b", "batch_storage_read_ns"]) == 0
    assert "no process.pid" in got.loc["b", "diagnostics"] and not got.loc["b", "partial"]


def _oracle(rid: str, arrival: int, first: int, spans: list[dict]) -> dict[str, int]:
    """Components and batch parts of one request, one nanosecond at a time."""
    out = {c: 0 for c in (*COMPONENTS, *BATCH_PARTS)}
    own = [s for s in spans if s["request_id"] == rid]
    worker = [s for s in own if s["name"] in WORKER]
    pids = Counter(s["pid"] for s in worker if s["pid"] >= 0)
    pid = min(pids, key=lambda p: (-pids[p], p)) if pids else None
    own_end = max((s["end_ns"] for s in worker), default=arrival)
    others = [s for s in spans if s["request_id"] != rid and s["name"] in WORKER
              and s["pid"] == pid]
    for t in range(arrival, first):
        open_own = {SPAN_COMPONENT.get(s["name"], s["name"]) for s in own
                    if s["start_ns"] <= t < s["end_ns"]}
        mine = next((c for c in DEFAULT_PRIORITY if c in open_own), None)
        if mine or open_own & {LOAD, STORE} or pid is None or t >= own_end:
            out[mine or "other"] += 1
            continue
        open_other = {SPAN_COMPONENT.get(s["name"], s["name"]) for s in others
                      if s["start_ns"] <= t < s["end_ns"]}
        theirs = next((c for c in DEFAULT_PRIORITY if c in open_other), None)
        out[theirs or "other"] += 1
        if theirs or open_other:
            out[f"batch_{theirs or 'other'}"] += 1
    return out


NAMES = sorted(WORKER | {NAME_OF["queueing"], NAME_OF["kv_lookup"]})
raw_span = st.tuples(st.sampled_from(["r0", "r1", "r2", "ghost"]), st.sampled_from(NAMES),
                     st.integers(-5, 70), st.integers(0, 30), st.sampled_from([1, 1, 2, -1]))


@settings(max_examples=150, deadline=None)
@given(arrivals=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 60)), min_size=3,
                         max_size=3),
       raw=st.lists(raw_span, max_size=16))
def test_batch_attribution_matches_an_oracle_and_parts_sum_exactly(arrivals, raw):
    requests = [{"request_id": f"r{i}", "arrival_ns": a, "first_token_ns": a + n}
                for i, (a, n) in enumerate(arrivals)]
    spans = [{"request_id": r, "name": name, "start_ns": s, "end_ns": s + d, "pid": pid}
             for r, name, s, d, pid in raw]  # "ghost" is in no request row: still the worker's
    got = attribute(memory_run(requests, spans), skew_tolerance_ns=10**9)
    for request in requests:
        row = _row(got, request["request_id"])
        expected = _oracle(request["request_id"], request["arrival_ns"],
                           request["first_token_ns"], spans)
        assert {k: row[k] for k in expected} == expected
        assert row["ttft"] == sum(row[c] for c in COMPONENTS)
        for part in BATCH_PARTS:
            assert 0 <= row[part] <= row[part.removeprefix("batch_")]
    storage = got[[f"{c}_ns" for c in STORAGE_PARTS]].sum(axis=1)
    assert (storage == got["storage_read_ns"]).all()


def test_recorded_live_step_of_sixteen_requests_loaded_one_after_another():
    """Spans and block I/O of a real cold run at concurrency 16 (kvscope-serial profile,
    tests/analysis/data/README.md): request 0 ran alone, the other 15 in one step whose
    synchronous load read and copied their KV one request after another."""
    run = load_run(LIVE)
    got = attribute(run).set_index("request_id")
    assert not got["partial"].any() and len(got) == 16
    assert (got[[f"{c}_ns" for c in COMPONENTS]].sum(axis=1) == got["ttft_ns"]).all()
    worker = run.spans[run.spans["name"].isin(WORKER)]
    assert worker["pid"].nunique() == 1  # one vLLM worker process did all of it
    for name in (NAME_OF["storage_read"], NAME_OF["transfer"]):  # serial: nothing overlaps
        spans = worker[worker["name"] == name].sort_values("start_ns")
        assert (spans["start_ns"].to_numpy()[1:] >= spans["end_ns"].to_numpy()[:-1]).all()
    arrival = run.requests.set_index("request_id")["arrival_ns"]
    for rid, row in got.iterrows():  # every read / copy of the worker from arrival to its prefill
        since = int(arrival[rid])
        until = int(worker.loc[worker["request_id"] == rid, "end_ns"].max())
        for name, component in ((NAME_OF["storage_read"], "storage_read"),
                                (NAME_OF["transfer"], "transfer")):
            spans = worker[worker["name"] == name]
            inside = (np.minimum(spans["end_ns"], until) - np.maximum(spans["start_ns"], since))
            assert int(row[f"{component}_ns"]) == int(inside.clip(lower=0).sum()), (rid, name)
    share = got["other_ns"].astype("float64") / got["ttft_ns"].astype("float64")
    assert share.median() < 0.10  # it was 0.87 before the batch was counted



def test_summary_reports_batch_parts_and_a_head_of_line_finding():
    run = load_run(LIVE)
    summary = summarize(run, attribute(run))
    group = summary["groups"][0]
    assert set(BATCH_PARTS) <= set(group["percentiles_ns"])
    assert group["share_of_ttft"]["other"] < 0.1
    found = [f for f in summary["findings"] if f["id"] == "batch-wait"]
    assert len(found) == 1 and "cold-c16 (conc 16)" in found[0]["message"]
    alone = memory_run([{"request_id": "r", "arrival_ns": 0, "first_token_ns": 100,
                        "cached_tokens": 256}],
                       [_span("r", "storage_read", 0, 90), _span("r", "prefill", 90, 100)])
    found = summarize(alone, attribute(alone))["findings"]
    assert found and not [f for f in found if f["id"] == "batch-wait"]
