"""The sweep against a brute-force oracle, and the edge cases the traps list names."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.analysis import DEFAULT_PRIORITY, attribute
from kvscope.analysis.attribution import COMPONENTS, SPAN_COMPONENT
from kvscope.testkit.memory_runs import memory_run

NAME_OF = {component: name for name, component in SPAN_COMPONENT.items()}
RID = "r0"


def _oracle(arrival: int, first: int, spans: list[tuple[str, int, int]]) -> dict[str, int]:
    """Exposed and hidden time per component, one nanosecond at a time."""
    out = {f"{c}_ns": 0 for c in COMPONENTS} | {f"hidden_{c}_ns": 0 for c in DEFAULT_PRIORITY}
    for t in range(arrival, first):
        open_ = {c for c, s, e in spans if s <= t < e}
        winner = next((c for c in DEFAULT_PRIORITY if c in open_), "other")
        out[f"{winner}_ns"] += 1
        for c in open_ - {winner}:
            out[f"hidden_{c}_ns"] += 1
    return out


interval = st.tuples(st.sampled_from(DEFAULT_PRIORITY), st.integers(-5, 60), st.integers(0, 30))


@settings(max_examples=200, deadline=None)
@given(arrival=st.integers(0, 10), length=st.integers(0, 50), raw=st.lists(interval, max_size=12))
def test_sweep_matches_a_nanosecond_by_nanosecond_oracle(arrival, length, raw):
    spans = [(c, s, s + d) for c, s, d in raw]
    run = memory_run([{"request_id": RID, "arrival_ns": arrival, "first_token_ns": arrival + length}],
                     [{"request_id": RID, "name": NAME_OF[c], "start_ns": s, "end_ns": e}
                      for c, s, e in spans])
    row = attribute(run, skew_tolerance_ns=10**9).iloc[0]
    expected = _oracle(arrival, arrival + length, spans)
    assert {k: int(row[k]) for k in expected} == expected
    assert int(row["ttft_ns"]) == length == sum(int(row[f"{c}_ns"]) for c in COMPONENTS)


def test_back_to_back_spans_touching_at_one_instant():
    run = memory_run([{"request_id": RID, "arrival_ns": 0, "first_token_ns": 30}], [
        {"request_id": RID, "name": NAME_OF["queueing"], "start_ns": 0, "end_ns": 10},
        {"request_id": RID, "name": NAME_OF["storage_read"], "start_ns": 10, "end_ns": 20},
        {"request_id": RID, "name": NAME_OF["prefill"], "start_ns": 20, "end_ns": 30},
    ])
    row = attribute(run).iloc[0]
    assert (row["queueing_ns"], row["storage_read_ns"], row["prefill_ns"], row["other_ns"]) == (10, 10, 10, 0)
    assert row["hidden_storage_read_ns"] == 0 and not row["partial"]


def test_child_outlasting_its_parent_keeps_its_full_time():
    run = memory_run([{"request_id": RID, "arrival_ns": 0, "first_token_ns": 100}], [
        {"request_id": RID, "name": "kvscope.kv.load", "start_ns": 10, "end_ns": 20},
        {"request_id": RID, "name": NAME_OF["storage_read"], "start_ns": 10, "end_ns": 60},
        {"request_id": RID, "name": NAME_OF["queueing"], "start_ns": 0, "end_ns": 10},
        {"request_id": RID, "name": NAME_OF["prefill"], "start_ns": 60, "end_ns": 100},
    ])
    row = attribute(run).iloc[0]
    assert row["storage_read_ns"] == 50 and row["other_ns"] == 0


def test_parallel_reads_count_once_and_overlap_under_transfer_is_hidden():
    reads = [{"request_id": RID, "name": NAME_OF["storage_read"], "start_ns": 0, "end_ns": e}
             for e in (40, 30, 40)]
    run = memory_run([{"request_id": RID, "arrival_ns": 0, "first_token_ns": 60}], reads + [
        {"request_id": RID, "name": NAME_OF["transfer"], "start_ns": 35, "end_ns": 60}])
    row = attribute(run).iloc[0]
    assert (row["storage_read_ns"], row["hidden_storage_read_ns"], row["transfer_ns"]) == (35, 5, 25)


def test_storage_split_puts_device_service_over_device_queue_over_software():
    attrs = {"kvscope.storage.reader_tids": [7, 8]}
    run = memory_run([{"request_id": RID, "arrival_ns": 0, "first_token_ns": 100}], [
        {"request_id": RID, "name": NAME_OF["storage_read"], "start_ns": 0, "end_ns": 100,
         "attributes": attrs}], block_io=[
        {"tid": 7, "start_ns": 10, "issue_ns": 20, "complete_ns": 40},
        {"tid": 8, "start_ns": 15, "issue_ns": 30, "complete_ns": 50},  # parallel, overlapping
        {"tid": 9, "start_ns": 60, "issue_ns": 70, "complete_ns": 80},  # someone else's thread
    ])
    row = attribute(run).iloc[0]
    assert (row["storage_device_service_ns"], row["storage_device_queue_ns"],
            row["storage_software_ns"]) == (30, 10, 60)
    assert row["block_io_count"] == 2


def test_priority_is_a_parameter_and_must_name_every_component():
    run = memory_run([{"request_id": RID, "arrival_ns": 0, "first_token_ns": 10}], [
        {"request_id": RID, "name": NAME_OF["queueing"], "start_ns": 0, "end_ns": 10},
        {"request_id": RID, "name": NAME_OF["storage_read"], "start_ns": 0, "end_ns": 10}])
    queue_first = ("prefill", "transfer", "queueing", "storage_read", "kv_lookup")
    row = attribute(run, priority=queue_first).iloc[0]
    assert (row["queueing_ns"], row["hidden_storage_read_ns"]) == (10, 10)
    try:
        attribute(run, priority=("prefill",))
    except ValueError as e:
        assert "priority must order exactly" in str(e)
    else:
        raise AssertionError("a partial priority was accepted")
    assert np.isfinite(row["ttft_ns"])
