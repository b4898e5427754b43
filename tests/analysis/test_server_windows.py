"""Requests only the server saw: their window is the server request span's, sums stay exact."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvscope.analysis import attribute
from kvscope.contract.semconv import SPAN_COLUMNS
from kvscope.analysis.run import Run, empty_table
from kvscope.analysis.server_requests import RECORDED_PHASE, with_server_requests
from kvscope.contract import semconv

MS = 1_000_000


def _span(trace: str, span_id: str, parent: str, name: str, start_ms: float, end_ms: float,
          rid: str, **attrs) -> tuple:
    return (trace, span_id, parent, name, int(start_ms * MS), int(end_ms * MS), rid,
            {semconv.REQUEST_ID: rid, **attrs}, "kvscope-vllm", 7)


def _spans() -> pd.DataFrame:
    a, b = "a" * 32, "b" * 32
    rows = [
        _span(a, "1" * 16, "", semconv.SPAN_SERVER_REQUEST, 1000, 2000, "req-a",
              **{semconv.GEN_AI_TTFT: 0.8, semconv.GEN_AI_PROMPT_TOKENS: 600,
                 semconv.GEN_AI_COMPLETION_TOKENS: 4}),
        _span(a, "2" * 16, "1" * 16, semconv.SPAN_QUEUE, 1010, 1110, "req-a"),
        _span(a, "3" * 16, "1" * 16, semconv.SPAN_KV_LOOKUP, 1110, 1115, "req-a"),
        _span(a, "4" * 16, "1" * 16, semconv.SPAN_KV_LOAD, 1120, 1290, "req-a",
              **{semconv.HIT_TOKENS: 512}),
        _span(a, "5" * 16, "1" * 16, semconv.SPAN_PREFILL, 1300, 1700, "req-a"),
        _span(b, "6" * 16, "", semconv.SPAN_SERVER_REQUEST, 5000, 5100, "req-b",
              **{semconv.ERROR_TYPE: "aborted"}),
        _span("c" * 32, "7" * 16, "", semconv.SPAN_CLIENT_REQUEST, 0, 10, "client-1"),
        _span("c" * 32, "8" * 16, "7" * 16, semconv.SPAN_SERVER_REQUEST, 1, 9, "client-1",
              **{semconv.GEN_AI_TTFT: 0.005}),
    ]
    return pd.DataFrame.from_records(rows, columns=list(SPAN_COLUMNS))


def _client_row() -> pd.DataFrame:
    row = {c: [0] for c in empty_table("requests").columns}
    row.update(request_id=["client-1"], phase=["warm"], trace_id=["c" * 32], status=["ok"],
               error=[""], first_token_ns=[6 * MS], finish_ns=[10 * MS], ttft_s=[0.006],
               e2e_s=[0.01])
    return pd.DataFrame(row).astype(empty_table("requests").dtypes.to_dict())


def test_server_only_requests_get_rows_client_rows_are_kept():
    phases = [{"name": "recording", "started_ns": 900 * MS, "ended_ns": 3000 * MS}]
    rows = with_server_requests(_client_row(), _spans(), phases).set_index("request_id")
    assert list(rows.index) == ["client-1", "req-a", "req-b"], "client-1 keeps its client row"
    assert rows.loc["client-1", "window"] == "client" and rows.loc["req-a", "window"] == "server"
    a = rows.loc["req-a"]
    assert (a.arrival_ns, a.first_token_ns, a.finish_ns) == (1000 * MS, 1800 * MS, 2000 * MS)
    assert (a.phase, a.prompt_tokens, a.cached_tokens, a.output_tokens, a.status) == (
        "recording", 600, 512, 4, "ok")
    b = rows.loc["req-b"]
    assert (b.phase, b.status, b.error) == (RECORDED_PHASE, "error", "aborted")


def test_a_server_window_is_split_exactly():
    run = Run(Path("."), {}, with_server_requests(empty_table("requests"), _spans(), []),
              _spans(), empty_table("block_io"), empty_table("queue_depth"),
              empty_table("nvme_io"))
    row = attribute(run).set_index("request_id").loc["req-a"]
    assert row["window"] == "server"
    assert row["ttft_ns"] == 800 * MS
    assert (row["queueing_ns"], row["kv_lookup_ns"], row["prefill_ns"]) == (
        100 * MS, 5 * MS, 400 * MS)
    parts = [f"{c}_ns" for c in ("queueing", "kv_lookup", "storage_read", "transfer",
                                 "prefill", "other")]
    assert sum(row[p] for p in parts) == row["ttft_ns"]
