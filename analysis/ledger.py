"""The chunk ledger: which tier served each looked-up chunk, why the others missed, and what
the misses cost.

`table(spans)` turns the worker's kv.ledger spans (one per request's LMCache lookup, one array
element per chunk) into the chunk_ledger table (contract.rundir.CHUNK_LEDGER), with vLLM's own
prefix-cache hits from the scheduler's kv.lookup span (kvscope.kv.vllm_cached_tokens) as tier
`vllm`. `per_request` gives the attribution's token columns (contract.chunk_outcomes
TOKEN_COLUMNS, exact integers, 0 for a request without a ledger), `summarize` the run's
per-tier hit rates and miss reasons with the TTFT they cost: recomputed tokens x the run's
measured prefill time per token (prefill spans' time over their kvscope.prefill.tokens).
A run from before schema v4 has no ledger spans: an empty table, zero columns, no summary.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from kvscope.analysis import spantable
from kvscope.contract import chunk_outcomes
from kvscope.contract import semconv
from kvscope.contract.rundir import CHUNK_LEDGER

DOMINANT_SHARE = 0.5  # a miss reason above this share of the missed tokens gets a finding
_ARRAYS = {  # table column -> span attribute (one element per chunk)
    "start_token": semconv.LEDGER_START, "end_token": semconv.LEDGER_END,
    "chunk_hash": semconv.LEDGER_KEY, "tier": semconv.LEDGER_TIER,
    "reason": semconv.LEDGER_REASON, "detail": semconv.LEDGER_DETAIL,
    "fact_ns": semconv.LEDGER_FACT_NS, "stored_ns": semconv.LEDGER_STORED_NS,
    "diverged_at": semconv.LEDGER_DIVERGED_AT,
}


def of_run(run: Any) -> pd.DataFrame:
    """The run's chunk ledger (`table(run.spans)`), made once per Run object."""
    cached = getattr(run, "_chunk_ledger", None)
    if cached is None or cached[0] is not run.spans:
        cached = (run.spans, table(run.spans))
        run._chunk_ledger = cached
    return cached[1]


def empty() -> pd.DataFrame:
    return CHUNK_LEDGER.schema.empty_table().to_pandas()


def table(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per chunk of each request's last LMCache lookup (CHUNK_LEDGER columns)."""
    ledger_spans = spans[spans["name"] == semconv.SPAN_KV_LEDGER]
    if ledger_spans.empty:
        return empty()
    last = ledger_spans.sort_values("start_ns", kind="stable").drop_duplicates(
        "request_id", keep="last")
    vllm_cached = _vllm_cached(spans)
    frames = []
    arrays = {column: spantable.values(last, key) for column, key in _ARRAYS.items()}
    vllm_ids = spantable.values(last, semconv.VLLM_REQUEST_ID)
    row: Any  # a span row (pandas types its fields as any scalar)
    for i, row in enumerate(last.itertuples(index=False)):
        n = len(arrays["start_token"][i] or [])
        if n == 0 or any(len(arrays[c][i] or []) != n for c in _ARRAYS):
            continue  # an empty or malformed record
        frame = pd.DataFrame({column: list(arrays[column][i]) for column in _ARRAYS})
        frame.insert(0, "chunk_index", np.arange(n))
        frame.insert(0, "lookup_ns", int(row.start_ns))
        frame.insert(0, "vllm_request_id", str("" if vllm_ids[i] is None else vllm_ids[i]))
        frame.insert(0, "request_id", str(row.request_id))
        cached = vllm_cached.get(str(row.request_id), 0)
        local = frame["end_token"].to_numpy() <= cached
        frame.loc[local, ["tier", "reason", "detail"]] = [chunk_outcomes.TIER_VLLM, "", ""]
        frames.append(frame)
    if not frames:
        return empty()
    out = pd.concat(frames, ignore_index=True)
    out["tokens"] = out["end_token"] - out["start_token"]
    out = out[list(CHUNK_LEDGER.columns)]
    ints = [f.name for f in CHUNK_LEDGER.schema if f.type == "int64"]
    return out.astype({c: "int64" for c in ints} | {c: str for c in CHUNK_LEDGER.columns
                                                   if c not in ints})


def _vllm_cached(spans: pd.DataFrame) -> dict[str, int]:
    """Per request, vLLM's own prefix-cache hit tokens at its (last) lookup."""
    lookups = spans[spans["name"] == semconv.SPAN_KV_LOOKUP].sort_values("start_ns",
                                                                        kind="stable")
    out: dict[str, int] = {}
    for rid, value in zip(lookups["request_id"],
                          spantable.values(lookups, semconv.VLLM_CACHED_TOKENS)):
        if value is not None:
            out[str(rid)] = int(value)
    return out


def per_request(ledger: pd.DataFrame, request_ids: pd.Series) -> pd.DataFrame:
    """TOKEN_COLUMNS for each of `request_ids` (int64, 0 without a ledger)."""
    ids = request_ids.astype(str).to_numpy()
    out = pd.DataFrame(0, index=range(len(ids)), columns=list(chunk_outcomes.TOKEN_COLUMNS),
                       dtype="int64")
    if ledger.empty:
        return out
    position = pd.Series(np.arange(len(ids)), index=ids)
    position = position[~position.index.duplicated()]
    rows = ledger[ledger["request_id"].isin(position.index)]
    key = position[rows["request_id"]].to_numpy()
    tokens = rows["tokens"].to_numpy()
    out["ledger_chunks"] = np.bincount(key, minlength=len(ids)).astype(np.int64)
    out["ledger_tokens"] = np.bincount(key, tokens, minlength=len(ids)).astype(np.int64)
    hit = rows["tier"].to_numpy() != chunk_outcomes.TIER_NONE
    for tier in chunk_outcomes.TIERS:
        sel = hit & (rows["tier"].to_numpy() == tier)
        out[chunk_outcomes.hit_tokens_column(tier)] = _sum(key, tokens, sel, len(ids))
    for reason in chunk_outcomes.REASONS:
        sel = ~hit & (rows["reason"].to_numpy() == reason)
        out[chunk_outcomes.missed_tokens_column(reason)] = _sum(key, tokens, sel, len(ids))
    return out


def _sum(key: np.ndarray, tokens: np.ndarray, sel: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(key[sel], tokens[sel], minlength=n).astype(np.int64)


def prefill_ns_per_token(spans: pd.DataFrame) -> float | None:
    """The run's measured prefill time per computed token (None without prefill tokens)."""
    prefill = spans[spans["name"] == semconv.SPAN_PREFILL]
    tokens = np.array([int(v or 0) for v in spantable.values(prefill, semconv.PREFILL_TOKENS)],
                      dtype=np.int64)
    if tokens.sum() <= 0:
        return None
    counted = tokens > 0
    ns = (prefill["end_ns"] - prefill["start_ns"]).to_numpy()[counted]
    return float(ns.sum()) / float(tokens[counted].sum())


def summarize(ledger: pd.DataFrame, spans: pd.DataFrame) -> dict[str, Any] | None:
    """summary["chunk_ledger"]: tokens and hit rate per tier, miss reasons by tokens (each with
    chunks, share of the missed tokens, TTFT cost, details); None when the run has no ledger."""
    return tally(ledger, prefill_ns_per_token(spans))


def tally(ledger: pd.DataFrame, rate: float | None) -> dict[str, Any] | None:
    """summarize() of any subset of a run's ledger rows (a phase, say), given the run's prefill
    time per token `rate`."""
    if ledger.empty:
        return None
    total = int(ledger["tokens"].sum())
    hits = ledger[ledger["tier"] != chunk_outcomes.TIER_NONE]
    misses = ledger[ledger["tier"] == chunk_outcomes.TIER_NONE]
    missed = int(misses["tokens"].sum())
    tiers: dict[str, dict[str, Any]] = {tier: {"chunks": int((hits["tier"] == tier).sum()),
                    "tokens": int(hits.loc[hits["tier"] == tier, "tokens"].sum())}
             for tier in chunk_outcomes.TIERS}
    for tier in tiers.values():
        tier["hit_rate"] = tier["tokens"] / total if total else None
    reasons: list[dict[str, Any]] = []
    for reason, group in misses.groupby("reason", sort=False):
        tokens = int(group["tokens"].sum())
        reasons.append({
            "reason": str(reason), "chunks": len(group), "tokens": tokens,
            "share_of_missed": tokens / missed if missed else None,
            "ttft_cost_s": tokens * rate / 1e9 if rate is not None else None,
            "details": {str(k): int(v) for k, v in
                        group.groupby("detail")["tokens"].sum().sort_values(
                            ascending=False).head(5).items()},
            "median_age_s": _median_age(group),
        })
    reasons.sort(key=lambda r: (-r["tokens"], r["reason"]))
    return {"requests": int(ledger["request_id"].nunique()), "chunks": len(ledger),
            "tokens": total, "hit_tokens": total - missed, "missed_tokens": missed,
            "hit_rate": (total - missed) / total if total else None, "tiers": tiers,
            "misses": reasons, "prefill_ns_per_token": rate}


def _median_age(group: pd.DataFrame) -> float | None:
    """Median seconds from store to the fact (eviction, refusal...), where both are known."""
    known = (group["stored_ns"] >= 0) & (group["fact_ns"] >= group["stored_ns"])
    if not known.any():
        return None
    return float((group.loc[known, "fact_ns"] - group.loc[known, "stored_ns"]).median()) / 1e9


_SAY = {
    chunk_outcomes.NEVER_STORED: "were never stored before (first time seen)",
    chunk_outcomes.PARTIAL_CHUNK: "were in a prompt's last, partial chunk (LMCache stores full chunks)",
    chunk_outcomes.STORE_QUEUED: "were still queued for the disk write",
    chunk_outcomes.STORE_QUEUE_FULL: "were dropped from a full disk write queue",
    chunk_outcomes.STORE_NO_SPACE: "found no evictable disk space",
    chunk_outcomes.STORE_ENOSPC: "failed their disk write with ENOSPC",
    chunk_outcomes.STORE_ERROR: "failed their disk write",
    chunk_outcomes.EVICTED_DISK: "were evicted by the disk capacity",
    chunk_outcomes.EVICTED_CPU: "were evicted from LMCache's CPU tier with no disk copy",
    chunk_outcomes.REFUSED: "were refused by the disk tier",
    chunk_outcomes.DIVERGED: "came after the prompt diverged from a stored prefix",
    chunk_outcomes.BEHIND_MISS: "were stored but came after a missed chunk",
    chunk_outcomes.LOAD_FAILED: "hit at lookup but were not loaded",
}


def finding(summary: dict[str, Any] | None) -> str | None:
    """A sentence when one miss reason holds more than DOMINANT_SHARE of the missed tokens."""
    if not summary or not summary["misses"]:
        return None
    top = summary["misses"][0]
    if top["share_of_missed"] is None or top["share_of_missed"] <= DOMINANT_SHARE:
        return None
    text = (f"{top['share_of_missed'] * 100:.0f} % of missed tokens ({top['tokens']} of "
            f"{summary['missed_tokens']}) {_SAY.get(top['reason'], top['reason'])}")
    detail = next(iter(top["details"]), "")
    if detail:
        text += f" ({detail})"
    if top["median_age_s"] is not None:
        text += f", a median {top['median_age_s']:.1f} s after being stored"
    if top["ttft_cost_s"] is not None:
        text += f"; recomputing them cost {top['ttft_cost_s']:.2f} s of prefill"
    return text
