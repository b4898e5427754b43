"""Request rows from server spans, for requests no client of kvscope's measured.

A server kvscope did not start (`kvscope record`, `kvscope import`) has no requests.parquet rows
of its own: every request is known only by its `kvscope.server.request` span. Its window is
server-side: the span's start (the API server's add_request) to its first token, the span's
start plus its `gen_ai.latency.time_to_first_token`. Both are integers of the tracer's
monotonic-ns stamps, so the components still sum to the window exactly. Requests with a client
row keep it (the client's window is what the user waited for); `window` says which one a row has.
A row's phase, concurrency and prompt index come from kvscope's client span in the same trace
when there is one (an imported `kvscope run`), else the phase is the manifest's phase around
the request's arrival.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from kvscope.analysis import spantable
from kvscope.contract import semconv

CLIENT, SERVER = "client", "server"  # values of the `window` column
RECORDED_PHASE = "recorded"  # a request outside every phase of the manifest
UNKNOWN = -1  # concurrency / prompt_index: no client said
SPAN_NAMES = (semconv.SPAN_SERVER_REQUEST, semconv.SPAN_CLIENT_REQUEST,
              semconv.SPAN_KV_LOAD)  # the spans read here


def with_server_requests(requests: pd.DataFrame, spans: pd.DataFrame,
                         phases: list[dict[str, Any]]) -> pd.DataFrame:
    """`requests` (window=client) plus one row (window=server) per server request span whose
    request has no client row; `phases` are the manifest's, which name each row's phase."""
    client = requests.assign(window=CLIENT)
    servers = spans[(spans["name"] == semconv.SPAN_SERVER_REQUEST)
                    & ~spans["request_id"].isin(set(requests["request_id"].astype(str)))]
    servers = servers.drop_duplicates("request_id")
    if servers.empty:
        return client
    rows = _rows(servers, spans, phases)
    return pd.concat([client, rows.astype(client.dtypes.to_dict())], ignore_index=True)


def _rows(servers: pd.DataFrame, spans: pd.DataFrame, phases: list[dict[str, Any]]
          ) -> pd.DataFrame:
    def attr(key: str, default: Any) -> list[Any]:
        return [default if v is None else v for v in spantable.values(servers, key)]

    clients = spans[spans["name"] == semconv.SPAN_CLIENT_REQUEST]
    traces = servers["trace_id"].to_numpy()
    workload = {key: dict(zip(clients["trace_id"], spantable.values(clients, key)))
                for key in (semconv.PHASE, semconv.CONCURRENCY, semconv.PROMPT_INDEX)}

    def said(key: str) -> list[Any]:  # what each request's client span said, None if nothing
        return [workload[key].get(t) for t in traces]

    ttft_ns = np.array([round(float(v) * 1e9) for v in attr(semconv.GEN_AI_TTFT, -1.0)],
                       dtype=np.int64)
    arrival = servers["start_ns"].to_numpy(np.int64)
    finish = servers["end_ns"].to_numpy(np.int64)
    served = ttft_ns >= 0
    errors = [str(v) for v in attr(semconv.ERROR_TYPE, "")]
    ok = served & np.array([not e for e in errors])
    first = np.where(served, arrival + ttft_ns, 0)
    return pd.DataFrame({
        "request_id": servers["request_id"].astype(str).to_numpy(),
        "phase": [str(p or _phase_of(t, phases)) for p, t in zip(said(semconv.PHASE), arrival)],
        "concurrency": [UNKNOWN if c is None else int(c) for c in said(semconv.CONCURRENCY)],
        "prompt_index": [UNKNOWN if i is None else int(i) for i in said(semconv.PROMPT_INDEX)],
        "trace_id": servers["trace_id"].to_numpy(),
        "prompt_tokens": [int(v) for v in attr(semconv.GEN_AI_PROMPT_TOKENS, 0)],
        "cached_tokens": _loaded_tokens(spans, servers["request_id"]),
        "output_tokens": [int(v) for v in attr(semconv.GEN_AI_COMPLETION_TOKENS, 0)],
        "arrival_ns": arrival, "first_token_ns": first, "finish_ns": finish,
        "ttft_s": np.where(served, ttft_ns / 1e9, np.nan), "e2e_s": (finish - arrival) / 1e9,
        "status": np.where(ok, "ok", "error"),
        "error": [e or ("" if s else "no first token") for e, s in zip(errors, served)],
        "window": SERVER,
    })


def _loaded_tokens(spans: pd.DataFrame, request_ids: pd.Series) -> list[int]:
    """Prompt tokens each request loaded from LMCache (its kv.load spans' hit tokens)."""
    loads = spans[spans["name"] == semconv.SPAN_KV_LOAD]
    hits = loads.assign(hit=[max(int(0 if v is None else v), 0)
                             for v in spantable.values(loads, semconv.HIT_TOKENS)])
    by_request = hits.groupby("request_id")["hit"].sum()
    return [int(by_request.get(rid, 0)) for rid in request_ids]


def _phase_of(arrival_ns: int, phases: list[dict[str, Any]]) -> str:
    for phase in phases:
        if int(phase.get("started_ns", 0)) <= arrival_ns <= int(phase.get("ended_ns", 0)):
            return str(phase["name"])
    return RECORDED_PHASE
