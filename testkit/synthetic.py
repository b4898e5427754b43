"""Synthetic run directories whose TTFT components are known by construction (a test kit).

Tests and benches use them to check analysis and the dashboard against a known truth; they
are written like a real run, through contract.rundir and the OpenTelemetry SDK's OTLP
encoder, so they pass the same loader and schema checks.

Every request follows one timeline (times in ns, `a` = arrival, each gap may be zero, so spans
touch back to back):

    a -g0- queue[q] -g1- reads[R] ... transfer[t] ... prefill[p] -g3- first token
                 lookup[l] ends with the queue;   k parallel reads start together, the longest
    lasts R; the transfer starts x before the reads end; prefill starts y before the transfer
    ends; kv.load (the reads' parent) may end before its children. Misses skip reads/transfer.

so exposed components are queueing q-l, kv_lookup l, storage_read R-x, transfer t-y, prefill p,
other g0+g1+g3, with hidden queueing l, storage_read x, transfer y. Block I/Os sit in the
exposed read stretch, each on a reader thread whose read covers it, so their device queue and
service times are exactly the storage split. `expected(path)` returns that truth.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvscope.contract import chunk_outcomes
from kvscope.testkit import synthetic_write

EXPECTED_FILE = "synthetic_expected.parquet"
MS = 1_000_000


def make_run(path: str | Path, *, n_requests: int, seed: int = 0, concurrency: int = 4,
             phases: tuple[str, ...] = ("cold",), reads_per_request: int = 2,
             ios_per_request: int = 10, hit_ratio: float = 0.8, nvme: bool = False,
             io_bytes: int = 1 << 20, spans_per_file: int = 50_000,
             ledger: bool = False, encoder: str = "sdk") -> Path:
    """Write a complete run (the contract's current schema) at `path` (which must not hold a run) and return it.

    Requests are split evenly over `phases`, run one after another; within a phase,
    `concurrency` lanes each run their requests back to back, each lane with its own reader
    threads and its own worker process (no request waits on another's work). The truth is
    written to RUN/synthetic_expected.parquet (see `expected`).

    `ledger`: each request also gets a chunk ledger (a kv.ledger span: PROMPT_TOKENS / 256
    chunks, a prefix served by vLLM (from its kv.lookup's vllm_cached_tokens), the CPU and
    the disk tier, the rest missed for a drawn reason), and its prefill span the number of
    tokens it computed; the truth then has the attribution's ledger columns.

    `encoder`: "sdk" (spans through the OpenTelemetry SDK and the tracer's encoder) or
    "direct" (the same documents built as dicts: for runs of millions of spans).
    """
    if n_requests < 0 or concurrency < 1 or reads_per_request < 1 or ios_per_request < 1:
        raise ValueError("n_requests >= 0, concurrency, reads_per_request, ios_per_request >= 1")
    if reads_per_request > synthetic_write.LEDGER_SPAN_NO - 9:
        raise ValueError(f"reads_per_request <= {synthetic_write.LEDGER_SPAN_NO - 9}")
    rng = np.random.default_rng(seed)
    plan = _plan(rng, n_requests, concurrency, phases, hit_ratio, reads_per_request)
    reads = _reads(rng, plan, reads_per_request, concurrency)
    io = _block_io(rng, plan, reads, ios_per_request, io_bytes)
    chunks = _ledger_chunks(np.random.default_rng(seed + 1), plan) if ledger else None
    path = synthetic_write.write(Path(path), plan, reads, io, nvme=nvme, seed=seed,
                                 concurrency=concurrency, phases=phases,
                                 spans_per_file=spans_per_file, chunks=chunks,
                                 encoder=encoder)
    truth = _truth(plan, io)
    if chunks is not None:
        truth = pd.concat([truth, _ledger_truth(chunks, len(plan))], axis=1)
    truth.to_parquet(path / EXPECTED_FILE, index=False)
    return path


def expected(path: str | Path) -> pd.DataFrame:
    """The known components of a synthetic run, in attribute()'s column names."""
    return pd.read_parquet(Path(path) / EXPECTED_FILE)


def _draw(rng: np.random.Generator, n: int, low_ms: float, high_ms: float) -> np.ndarray:
    """Durations in ns, uniform in [low, high] ms, about 1 in 8 exactly the lower bound."""
    values = rng.integers(int(low_ms * MS), int(high_ms * MS) + 1, n)
    return np.where(rng.random(n) < 0.125, int(low_ms * MS), values).astype(np.int64)


def _plan(rng: np.random.Generator, n: int, concurrency: int, phases: tuple[str, ...],
          hit_ratio: float, k: int) -> pd.DataFrame:
    """One row per request: its ids, every duration of the timeline and the absolute times."""
    idx = np.arange(n)
    phase_no = idx * len(phases) // max(n, 1)
    plan = pd.DataFrame({"phase_no": phase_no, "lane": idx % concurrency,
                         "hit": rng.random(n) < hit_ratio})
    hit = plan["hit"].to_numpy()
    plan["g0"], plan["q"], plan["g1"], plan["g3"] = (_draw(rng, n, 0, 2), _draw(rng, n, 0, 50),
                                                     _draw(rng, n, 0, 1), _draw(rng, n, 0, 2))
    plan["l"] = (plan["q"] * rng.random(n) * 0.3).astype(np.int64)
    plan["R"] = np.where(hit, _draw(rng, n, 5, 200), 0)
    plan["x"] = (plan["R"] * rng.random(n) * 0.25).astype(np.int64)
    plan["t"] = np.where(hit, plan["x"] + _draw(rng, n, 1, 50), 0)
    plan["p"] = np.where(hit, _draw(rng, n, 10, 300), _draw(rng, n, 50, 1500))
    overlap = ((plan["t"] - plan["x"]) * rng.random(n) * 0.5).astype(np.int64)
    plan["y"] = np.minimum(overlap, plan["p"])  # prefill outlasts the transfer it overlaps
    plan["decode"] = _draw(rng, n, 10, 100)
    plan["load_short"] = rng.random(n) < 0.5  # kv.load ends before its last child
    _place(plan, rng, phase_no)
    plan["prompt_index"] = idx - np.searchsorted(phase_no, phase_no)
    plan["request_id"] = [f"{phases[p]}-{i:07d}" for p, i in zip(phase_no, plan["prompt_index"])]
    return plan


def _place(plan: pd.DataFrame, rng: np.random.Generator, phase_no: np.ndarray) -> None:
    """Absolute times: lanes run back to back, phases one after another."""
    ttft = plan[["g0", "q", "g1", "R", "t", "p", "g3"]].sum(axis=1) - plan["x"] - plan["y"]
    busy = ttft + plan["decode"] + _draw(rng, len(plan), 0, 5)
    start = busy.groupby([phase_no, plan["lane"]]).cumsum() - busy
    span = (start + busy).groupby(phase_no).max().reindex(range(phase_no.max(initial=0) + 1),
                                                          fill_value=0)
    phase_base = 50_000 * 10**9 + (span + 10 * MS).cumsum().shift(1, fill_value=0)
    plan["arrival"] = phase_base.to_numpy()[phase_no] + start.to_numpy()
    plan["queue_start"] = plan["arrival"] + plan["g0"]
    plan["load_start"] = plan["queue_start"] + plan["q"] + plan["g1"]
    plan["transfer_start"] = plan["load_start"] + plan["R"] - plan["x"]
    plan["prefill_start"] = np.where(plan["hit"], plan["transfer_start"] + plan["t"] - plan["y"],
                                     plan["load_start"])
    plan["prefill_end"] = plan["prefill_start"] + plan["p"]
    plan["first_token"] = plan["prefill_end"] + plan["g3"]
    plan["finish"] = plan["first_token"] + plan["decode"]


def _reads(rng: np.random.Generator, plan: pd.DataFrame, k: int, concurrency: int) -> pd.DataFrame:
    """k parallel storage.read spans per hit request; read 0 is the longest (R)."""
    hits = plan[plan["hit"]]
    key = np.repeat(hits.index.to_numpy(), k)
    which = np.tile(np.arange(k), len(hits))
    longest = np.repeat(hits["R"].to_numpy(), k)
    frac = np.where(which == 0, 1.0, rng.uniform(0.3, 1.0, len(key)))
    start = np.repeat(hits["load_start"].to_numpy(), k)
    tid = 10_000 + np.repeat(hits["lane"].to_numpy(), k) * k + which
    return pd.DataFrame({"key": key, "which": which, "start": start,
                         "end": start + (longest * frac).astype(np.int64), "tid": tid})


def _block_io(rng: np.random.Generator, plan: pd.DataFrame, reads: pd.DataFrame, m: int,
              io_bytes: int) -> pd.DataFrame:
    """m block reads per hit request, laid out one after another in the exposed read stretch."""
    hits = plan[plan["hit"]]
    key = np.repeat(hits.index.to_numpy(), m)
    slot = np.repeat(((hits["R"] - hits["x"]) // m).to_numpy(), m)
    slot_start = np.repeat(hits["load_start"].to_numpy(), m) + np.tile(np.arange(m), len(hits)) * slot
    soft = (slot * rng.uniform(0.0, 0.3, len(key))).astype(np.int64)
    queue = np.where(rng.random(len(key)) < 0.2, 0, (slot * rng.uniform(0, 0.2, len(key))).astype(np.int64))
    service = (slot * rng.uniform(0.2, 0.5, len(key))).astype(np.int64)
    start = slot_start + soft
    complete = start + queue + service
    k = int(reads.groupby("key").size().max()) if len(reads) else 1
    reader = rng.integers(0, k, len(key))
    read_end = reads.set_index(["key", "which"])["end"]
    covered = read_end.reindex(pd.MultiIndex.from_arrays([key, reader])).to_numpy() >= complete
    reader = np.where(covered, reader, 0)  # read 0 covers the whole stretch
    tid = 10_000 + plan["lane"].to_numpy()[key] * k + reader
    return pd.DataFrame({"key": key, "tid": tid, "start_ns": start, "issue_ns": start + queue,
                         "complete_ns": complete, "bytes": io_bytes})


PROMPT_TOKENS = synthetic_write.PROMPT_TOKENS
CHUNK_TOKENS = 256
# (miss reason, detail) drawn for the chunks after the served prefix
MISSES = ((chunk_outcomes.NEVER_STORED, ""), (chunk_outcomes.EVICTED_DISK, "capacity 1073741824 bytes"),
          (chunk_outcomes.REFUSED, "checksum"), (chunk_outcomes.DIVERGED, "prefix diverged"),
          (chunk_outcomes.STORE_ENOSPC, "ENOSPC: No space left on device"),
          (chunk_outcomes.EVICTED_CPU, "no disk copy"))


def _ledger_chunks(rng: np.random.Generator, plan: pd.DataFrame) -> pd.DataFrame:
    """Per request, every chunk: served by vllm, cpu, disk (in that order) or missed.

    `span_tier` / `span_reason` are what the worker's ledger span says; `tier` / `reason` the
    truth after the join with vLLM's own hits (chunks inside vllm_cached_tokens)."""
    n_chunks = PROMPT_TOKENS // CHUNK_TOKENS
    rows = []
    for key, hit in enumerate(plan["hit"].to_numpy()):
        served = int(rng.integers(1, n_chunks + 1)) if hit else 0
        vllm = int(rng.integers(0, served + 1)) if served else int(rng.integers(0, 3))
        cpu = int(rng.integers(0, max(served - vllm, 0) + 1))
        miss, detail = MISSES[int(rng.integers(0, len(MISSES)))]
        stored = 1_000 * MS + key
        for i in range(n_chunks):
            tier = ("vllm" if i < vllm else "cpu" if i < vllm + cpu else "disk"
                    if i < served else "none")
            span_tier = chunk_outcomes.TIER_DISK if tier == "vllm" else tier  # LMCache held it too
            if tier == "vllm" and i >= served:
                span_tier = "none"  # vLLM had it, LMCache did not: the join still says vllm
            reason = "" if tier != "none" else miss
            said = miss if span_tier == "none" else ""  # what the worker's ledger says
            evicted = said == chunk_outcomes.EVICTED_DISK
            rows.append((key, i, i * CHUNK_TOKENS, (i + 1) * CHUNK_TOKENS, tier, reason,
                         span_tier, said, detail if said else "", stored if evicted else -1,
                         stored + 90 * 10**9 if evicted else -1,
                         i * CHUNK_TOKENS if said == chunk_outcomes.DIVERGED else -1, vllm))
    return pd.DataFrame(rows, columns=[
        "key", "chunk_index", "start", "end", "tier", "reason", "span_tier", "span_reason",
        "detail", "stored_ns", "fact_ns", "diverged_at", "vllm_chunks"])


def _ledger_truth(chunks: pd.DataFrame, n: int) -> pd.DataFrame:
    """The attribution's ledger columns of the drawn chunks."""
    tokens = (chunks["end"] - chunks["start"]).to_numpy()
    key = chunks["key"].to_numpy()
    out = {"ledger_chunks": np.bincount(key, minlength=n),
           "ledger_tokens": np.bincount(key, tokens, minlength=n)}
    for tier in chunk_outcomes.TIERS:
        sel = (chunks["tier"] == tier).to_numpy()
        out[chunk_outcomes.hit_tokens_column(tier)] = np.bincount(key[sel], tokens[sel], minlength=n)
    for reason in chunk_outcomes.REASONS:
        sel = ((chunks["tier"] == "none") & (chunks["reason"] == reason)).to_numpy()
        out[chunk_outcomes.missed_tokens_column(reason)] = np.bincount(key[sel], tokens[sel],
                                                              minlength=n)
    return pd.DataFrame(out).astype("int64")


def _truth(plan: pd.DataFrame, io: pd.DataFrame) -> pd.DataFrame:
    """The known attribution, in attribute()'s column names."""
    n = len(plan)
    service = np.bincount(io["key"], weights=io["complete_ns"] - io["issue_ns"], minlength=n)
    queue = np.bincount(io["key"], weights=io["issue_ns"] - io["start_ns"], minlength=n)
    truth = pd.DataFrame({
        "request_id": plan["request_id"], "ttft_ns": plan["first_token"] - plan["arrival"],
        "queueing_ns": plan["q"] - plan["l"], "kv_lookup_ns": plan["l"],
        "storage_read_ns": plan["R"] - plan["x"], "transfer_ns": plan["t"] - plan["y"],
        "prefill_ns": plan["p"], "other_ns": plan["g0"] + plan["g1"] + plan["g3"],
        "storage_device_queue_ns": queue.astype(np.int64),
        "storage_device_service_ns": service.astype(np.int64),
        "hidden_queueing_ns": plan["l"], "hidden_kv_lookup_ns": 0,
        "hidden_storage_read_ns": plan["x"], "hidden_transfer_ns": plan["y"],
        "hidden_prefill_ns": 0,
    })
    truth["storage_software_ns"] = (truth["storage_read_ns"] - truth["storage_device_queue_ns"]
                                    - truth["storage_device_service_ns"])
    return truth.astype({c: "int64" for c in truth.columns if c.endswith("_ns")})
