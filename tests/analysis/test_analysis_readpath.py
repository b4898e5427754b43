"""Where a phase's read bandwidth went, on a hand-built timeline with known gaps."""

from __future__ import annotations

import pandas as pd
import pytest

from kvscope.analysis import readpath
from kvscope.contract import semconv

MS = 1_000_000


def timeline() -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Two readers read twice back to back (5 ms apart) for r0, then the disk idles 125 ms while
    the worker copies (50 ms) and prefills (20 ms), then one more read, for r1, which arrived at
    140 ms: for the 95 ms before that no request waited for a read."""
    requests = pd.DataFrame({"request_id": ["r0", "r1"], "phase": ["cold-c2"] * 2})
    spans = pd.DataFrame([
        {"request_id": "r0", "name": semconv.SPAN_SERVER_REQUEST, "start_ns": 0,
         "end_ns": 160 * MS, "attributes": {}},
        {"request_id": "r0", "name": semconv.SPAN_STORAGE_READ, "start_ns": 0, "end_ns": 45 * MS,
         "attributes": {semconv.READER_TIDS: [10, 11]}},
        {"request_id": "r1", "name": semconv.SPAN_SERVER_REQUEST, "start_ns": 140 * MS,
         "end_ns": 200 * MS, "attributes": {}},
        {"request_id": "r1", "name": semconv.SPAN_STORAGE_READ, "start_ns": 165 * MS,
         "end_ns": 190 * MS, "attributes": {semconv.READER_TIDS: [10]}},
        {"request_id": "r0", "name": semconv.SPAN_KV_TRANSFER, "start_ns": 100 * MS,
         "end_ns": 150 * MS, "attributes": {}},
        {"request_id": "r1", "name": semconv.SPAN_PREFILL, "start_ns": 150 * MS,
         "end_ns": 170 * MS, "attributes": {}},
        {"request_id": "other", "name": semconv.SPAN_KV_TRANSFER, "start_ns": 50 * MS,
         "end_ns": 90 * MS, "attributes": {}},  # another phase's request: not a cause here
    ])
    reads = [(10, 0, 20), (10, 25, 45), (11, 0, 20), (11, 25, 45), (10, 170, 190),
             (99, 60, 80)]  # tid 99: not a reader of this backend (another process's I/O)
    block_io = pd.DataFrame([{"phase": "cold-c2", "op": "R", "tid": t, "bytes": 4 << 20,
                              "start_ns": s * MS, "issue_ns": (s + 1) * MS, "complete_ns": e * MS}
                             for t, s, e in reads])
    return block_io, spans, requests


def test_idle_time_and_reader_gaps_are_measured_from_the_timeline():
    [r] = readpath.per_phase(*timeline())
    assert r["readers"] == 2 and r["reads"] == 5
    assert r["read_span_s"] == pytest.approx(0.190)
    assert r["busy_s"] == pytest.approx(0.060)
    assert r["idle_s"] == pytest.approx(0.130)
    assert r["idle_transfer_s"] == pytest.approx(0.050)
    assert r["idle_prefill_s"] == pytest.approx(0.020)
    assert r["idle_unasked_s"] == pytest.approx(0.095)  # 45-140 ms: r0 read all, r1 not here
    assert r["in_flight_while_busy"] == pytest.approx(100 / 60)
    assert r["io_p50_ms"] == pytest.approx(19.0)
    assert r["reader_gap_p50_ms"] == pytest.approx(5.0)  # the 125 ms wait for work is not a gap
    assert r["busy_bytes_per_s"] == pytest.approx(5 * (4 << 20) / 0.060)
    said = readpath.words(r)
    assert "idle 68% of the 0.19 s read span" in said and "0.05 s of it while the worker copied" in said
    assert "0.10 s while no request was waiting for its reads" in said
    assert "1.7 reads of 2 readers" in said and "5.0 ms (p50" in said


def test_no_reader_reads_no_row():
    block_io, spans, requests = timeline()
    assert readpath.per_phase(block_io[block_io["tid"] == 99], spans, requests) == []
    assert readpath.per_phase(block_io, spans.iloc[0:0], requests) == []
