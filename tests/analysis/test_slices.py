"""Attribution in slices gives the rows of one pass over the run, bit for bit: with requests
waiting on each other in one worker, repeated request ids, failed requests and reads that
overlap on a reader thread."""

from __future__ import annotations

import pandas as pd
import pytest

from kvscope import analysis
from kvscope.analysis import slices
from kvscope.analysis.attribution import attribute_tables
from kvscope.contract import semconv
from kvscope.testkit import synthetic
from kvscope.testkit.memory_runs import memory_run

MS = 1_000_000


@pytest.fixture(scope="module")
def shared_worker_run(tmp_path_factory: pytest.TempPathFactory) -> analysis.Run:
    """A synthetic run whose lanes all run in one vLLM process, so requests wait on the batch."""
    path = synthetic.make_run(tmp_path_factory.mktemp("slices") / "run", n_requests=400,
                              seed=11, concurrency=6, phases=("warm", "cold"))
    run = analysis.load_run(path, typed=True)
    run.spans["pid"] = run.spans["pid"].min()
    return run


@pytest.mark.parametrize("size", [19, 150])
def test_slices_give_the_whole_runs_rows(shared_worker_run, size):
    run = shared_worker_run
    whole = attribute_tables(run.requests, run.spans, run.block_io, run.request_notes,
                             have_block_io=True)
    assert (whole["batch_prefill_ns"] > 0).sum() > 5  # the batch path is at work
    got = slices.attribute(run.requests, run.spans, run.block_io, run.request_notes,
                           slice_requests=size)
    pd.testing.assert_frame_equal(got, whole)


def test_repeated_ids_failures_and_overlapping_reads_slice_alike():
    read = {"name": semconv.SPAN_STORAGE_READ,
            "attributes": {semconv.READER_TIDS: [9], semconv.READ_BYTES: 4096}}
    requests = [{"request_id": f"r{i}", "arrival_ns": i * 40 * MS,
                 "first_token_ns": i * 40 * MS + 100 * MS} for i in range(6)]
    requests.append({"request_id": "r2", "arrival_ns": 500 * MS, "first_token_ns": 600 * MS})
    requests[4].update(status="error", first_token_ns=-1, error="boom")
    spans = []
    for i in range(6):
        start = i * 40 * MS
        spans += [{"request_id": f"r{i}", "name": semconv.SPAN_QUEUE, "start_ns": start,
                   "end_ns": start + 10 * MS},
                  {"request_id": f"r{i}", **read, "start_ns": start + 10 * MS,
                   "end_ns": start + 70 * MS},  # still open when the next request's read starts
                  {"request_id": f"r{i}", "name": semconv.SPAN_PREFILL,
                   "start_ns": start + 70 * MS, "end_ns": start + 90 * MS}]
    block_io = [{"tid": 9, "start_ns": t * MS, "issue_ns": t * MS + MS,
                 "complete_ns": t * MS + 5 * MS} for t in range(12, 260, 9)]
    run = memory_run(requests, spans, block_io)
    whole = analysis.attribute(run)
    assert whole["diagnostics"].str.contains("overlapping reads").any()
    assert whole["diagnostics"].str.contains("repeats").any()
    for size in (1, 2, 3):
        got = slices.attribute(run.requests, run.spans, run.block_io, run.request_notes,
                               slice_requests=size)
        pd.testing.assert_frame_equal(got, whole)


def test_slices_in_worker_processes_give_the_same_rows(shared_worker_run):
    """Slices handed to two spawned worker processes (what a run of many slices gets on a
    machine of several cores) come back as the rows of slices attributed here."""
    run = shared_worker_run
    here = slices.attribute(run.requests, run.spans, run.block_io, run.request_notes,
                            slice_requests=100, workers=1)
    workers = slices.attribute(run.requests, run.spans, run.block_io, run.request_notes,
                               slice_requests=100, workers=2)
    pd.testing.assert_frame_equal(workers, here)
