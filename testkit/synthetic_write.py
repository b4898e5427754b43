"""Write a synthetic plan (testkit.synthetic) out as a run directory, as producers do.

Tables go through contract.rundir (the same schema checks as every producer). Spans are SDK
spans encoded by the tracer's own OTLP JSON encoding (`encoder="sdk"`), so the test kit cannot
write a document the tracer would not; that costs about 100 us per span. `encoder="direct"`
builds the same documents as plain dicts and writes them with msgspec (a few us per span, for
the benchmarks' millions of spans); a test holds the two to the same parsed documents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import msgspec
import numpy as np
import pandas as pd

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from kvscope.contract import otlp_json, rundir, semconv
from kvscope.tracer.fileexport import span_file

OFFSET_NS = 1_700_000_000 * 10**9 - 50_000 * 10**9  # epoch = monotonic + this
KV_BYTES_PER_TOKEN = 262_144  # Qwen2.5-32B, bf16
PROMPT_TOKENS = 8192  # every synthetic prompt
LEDGER_SPAN_NO = 31  # a request's kv.ledger span number (reads are 9, 10, ...)
LANE_PID = 20_000  # lane k's spans come from process LANE_PID + k (lanes never share a worker)
SERVICE = "kvscope-synthetic"
SCOPE = "kvscope.synthetic"


def write(path: Path, plan: pd.DataFrame, reads: pd.DataFrame, io: pd.DataFrame, *,
          nvme: bool, seed: int, concurrency: int, phases: tuple[str, ...],
          spans_per_file: int, chunks: pd.DataFrame | None = None,
          encoder: str = "sdk") -> Path:
    """Create the run: manifest, requests, spans, block I/O, queue depth (and NVMe)."""
    rundir.create(path, _manifest(path, plan, seed, concurrency, phases))
    plan = plan.assign(phase=np.asarray(phases)[plan["phase_no"].to_numpy()])
    rundir.append_table(path, "requests", _requests(plan, concurrency))
    _write_spans(path, _spans(plan, reads, io, chunks), spans_per_file, encoder)
    block = _block_table(plan, io, seed)
    rundir.append_table(path, "block_io", block)
    rundir.append_table(path, "queue_depth", _queue_depth(block))
    if nvme:
        rundir.append_table(path, "nvme_io", _nvme(block))
    return path


def _manifest(path: Path, plan: pd.DataFrame, seed: int, concurrency: int,
              phases: tuple[str, ...]) -> dict[str, Any]:
    by_phase = plan.groupby("phase_no")
    return {
        "run_id": path.name, "created_at": "2026-01-01T00:00:00Z",
        "command": ["kvscope.testkit.synthetic.make_run"],
        "model": {"twin": "qwen2.5-32b", "num_layers": 64, "num_kv_heads": 8, "head_dim": 128,
                  "dtype": "bfloat16", "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
                  "chunk_tokens": 256, "kv_bytes_per_chunk": 256 * KV_BYTES_PER_TOKEN},
        "backend": {"profile": "synthetic"},
        "workload": {"num_requests": len(plan), "concurrency": [concurrency], "seed": seed,
                     "phases": list(phases)},
        "machine": {"hostname": "synthetic", "disk_device": "vda"},
        "versions": {"kvscope": "synthetic"},
        "clock": {"offset_ns": OFFSET_NS, "uncertainty_ns": 1000},
        "phases": [{"name": phases[int(g["phase_no"].to_numpy()[0])], "concurrency": concurrency,
                    "started_ns": int(g["arrival"].min()), "ended_ns": int(g["finish"].max()),
                    "num_requests": len(g), "num_errors": 0} for _, g in by_phase],
        "probes": {"mode": "synthetic"}, "tracer": {"enabled": True, "exporters": ["synthetic"]},
    }


def _requests(plan: pd.DataFrame, concurrency: int) -> pd.DataFrame:
    n = len(plan)
    return pd.DataFrame({
        "request_id": plan["request_id"].astype(str), "phase": plan["phase"].astype(str),
        "concurrency": concurrency, "prompt_index": plan["prompt_index"].astype(np.int64),
        "trace_id": _trace_ids(plan.index.to_numpy()), "prompt_tokens": PROMPT_TOKENS,
        "cached_tokens": np.where(plan["hit"], PROMPT_TOKENS - 16, 0), "output_tokens": np.full(n, 16),
        "arrival_ns": plan["arrival"], "first_token_ns": plan["first_token"],
        "finish_ns": plan["finish"], "ttft_s": (plan["first_token"] - plan["arrival"]) / 1e9,
        "e2e_s": (plan["finish"] - plan["arrival"]) / 1e9, "status": "ok", "error": "",
    })


def _trace_ids(keys: Any) -> pd.Series:
    """W3C trace ids, one per request key (str even when there are none)."""
    return pd.Series([_trace_id(k) for k in keys], dtype=str)


def _trace_id(key: int) -> str:
    return f"5eed{key:028x}"


def _spans(plan: pd.DataFrame, reads: pd.DataFrame, io: pd.DataFrame,
           chunks: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every span: key, number within the request, parent number, name, start, end, attrs."""
    p, hit = plan, plan["hit"].to_numpy()
    load_end = np.where(p["load_short"], p["load_start"] + p["R"], p["transfer_start"] + p["t"])
    table = [  # (number, parent, name, start, end, rows)
        (1, 0, semconv.SPAN_CLIENT_REQUEST, p["arrival"], p["finish"], slice(None)),
        (2, 1, semconv.SPAN_QUEUE, p["queue_start"], p["queue_start"] + p["q"], slice(None)),
        (3, 1, semconv.SPAN_KV_LOOKUP, p["queue_start"] + p["q"] - p["l"],
         p["queue_start"] + p["q"], slice(None)),
        (4, 1, semconv.SPAN_PREFILL, p["prefill_start"], p["prefill_end"], slice(None)),
        (5, 1, semconv.SPAN_KV_STORE, p["prefill_end"], p["prefill_end"] + p["g3"] // 2,
         slice(None)),
        (6, 1, semconv.SPAN_FIRST_TOKEN, p["prefill_end"], p["prefill_end"], slice(None)),
        (7, 1, semconv.SPAN_KV_LOAD, p["load_start"], load_end, hit),
        (8, 7, semconv.SPAN_KV_TRANSFER, p["transfer_start"], p["transfer_start"] + p["t"], hit),
    ]
    table_rows: list[tuple[int, int, str, Any, Any, Any]] = table
    frames = [pd.DataFrame({"key": p.index.to_numpy()[rows], "no": no, "parent": parent,
                            "name": name, "start": np.asarray(start)[rows],
                            "end": np.asarray(end)[rows]})
              for no, parent, name, start, end, rows in table_rows]
    per_read = io.groupby(["key", "tid"]).size()
    read_ios = per_read.reindex(pd.MultiIndex.from_arrays([reads["key"], reads["tid"]]),
                                fill_value=0).to_numpy()
    frames.append(pd.DataFrame({
        "key": reads["key"], "no": 9 + reads["which"], "parent": 7,
        "name": semconv.SPAN_STORAGE_READ, "start": reads["start"], "end": reads["end"],
        "tid": reads["tid"], "read_bytes": read_ios * int(io["bytes"].iloc[0] if len(io) else 0)}))
    if chunks is not None:
        frames.append(_ledger_spans(p, chunks))
    spans = pd.concat(frames, ignore_index=True)
    if chunks is not None:
        _ledger_attributes(spans, chunks)
    spans["request_id"] = plan["request_id"].to_numpy()[spans["key"].to_numpy()]
    spans["phase"] = plan["phase"].to_numpy()[spans["key"].to_numpy()]
    spans["lane"] = plan["lane"].to_numpy()[spans["key"].to_numpy()]
    return spans.sort_values(["key", "no"], kind="stable").reset_index(drop=True)


def _ledger_spans(plan: pd.DataFrame, chunks: pd.DataFrame) -> pd.DataFrame:
    """One kv.ledger span per request, inside its lookup, with its chunks as arrays."""
    lookup_end = (plan["queue_start"] + plan["q"]).to_numpy()
    attrs: dict[Any, dict[str, Any]] = {}
    for key, group in chunks.groupby("key"):
        attrs[key] = {
            semconv.LEDGER_START: group["start"].tolist(),
            semconv.LEDGER_END: group["end"].tolist(),
            semconv.LEDGER_KEY: [f"{key:08x}{i:08x}" for i in group["chunk_index"]],
            semconv.LEDGER_TIER: group["span_tier"].tolist(),
            semconv.LEDGER_REASON: group["span_reason"].tolist(),
            semconv.LEDGER_DETAIL: [d if r else "" for d, r in zip(group["detail"],
                                                                    group["span_reason"])],
            semconv.LEDGER_FACT_NS: group["fact_ns"].tolist(),
            semconv.LEDGER_STORED_NS: group["stored_ns"].tolist(),
            semconv.LEDGER_DIVERGED_AT: group["diverged_at"].tolist(),
            semconv.LEDGER_DROPPED: 0,
        }
    keys = np.array(sorted(attrs))
    return pd.DataFrame({"key": keys, "no": LEDGER_SPAN_NO, "parent": 1,
                         "name": semconv.SPAN_KV_LEDGER, "start": lookup_end[keys] - 1,
                         "end": lookup_end[keys], "attrs": [attrs[k] for k in keys]})


def _ledger_attributes(spans: pd.DataFrame, chunks: pd.DataFrame) -> None:
    """vLLM's own hits on each kv.lookup, the computed tokens on each prefill (in place)."""
    first = chunks.groupby("key").first()
    computed = chunks[chunks["tier"] == "none"].groupby("key").size().reindex(
        first.index, fill_value=0) * (chunks["end"] - chunks["start"]).iloc[0]
    vllm = first["vllm_chunks"] * (chunks["end"] - chunks["start"]).iloc[0]
    attrs: list[Any] = spans["attrs"].tolist() if "attrs" in spans else [None] * len(spans)
    names, keys = spans["name"].to_numpy(), spans["key"].to_numpy()
    for i in np.flatnonzero(names == semconv.SPAN_KV_LOOKUP):
        attrs[i] = {semconv.VLLM_CACHED_TOKENS: int(vllm[keys[i]])}
    for i in np.flatnonzero(names == semconv.SPAN_PREFILL):
        attrs[i] = {semconv.PREFILL_TOKENS: int(computed[keys[i]])}
    spans["attrs"] = pd.Series(attrs, index=spans.index, dtype=object)


def _write_spans(path: Path, spans: pd.DataFrame, per_file: int, encoder: str) -> None:
    """The spans as OTLP JSON documents of at most `per_file` spans, encoded as the tracer's
    file exporter encodes its batches (SDK spans -> ExportTraceServiceRequest -> hex-id JSON),
    or built directly in that form (`encoder="direct"`)."""
    encode = {"sdk": lambda chunk: span_file(_sdk_spans(chunk)).encode(),
              "direct": lambda chunk: msgspec.json.encode(_direct_document(chunk))}[encoder]
    for number, first in enumerate(range(0, max(len(spans), 1), per_file)):
        (path / rundir.SPANS_DIR / f"synthetic-{number:04d}.json").write_bytes(
            encode(spans.iloc[first:first + per_file]))


def _direct_document(spans: pd.DataFrame) -> dict[str, Any]:
    """What span_file writes for these spans' SDK spans, built without them."""
    by_lane: dict[int, list[dict[str, Any]]] = {}
    rows: Iterable[Any] = spans.itertuples(index=False)
    for row in rows:
        key, number, parent_number = int(row.key), int(row.no), int(row.parent)
        span: dict[str, Any] = {"traceId": _trace_id(key), "spanId": f"{key * 32 + number:016x}"}
        if parent_number:
            span["parentSpanId"] = f"{key * 32 + parent_number:016x}"
        attributes = _attributes(row)
        span.update({
            "name": row.name, "kind": SpanKind.INTERNAL.value + 1,  # OTLP's number for it
            "startTimeUnixNano": str(int(row.start) + OFFSET_NS),
            "endTimeUnixNano": str(int(row.end) + OFFSET_NS),
            "attributes": otlp_json.json_attributes(attributes),
            "status": {}, "flags": 256})
        by_lane.setdefault(int(row.lane), []).append(span)
    return {"resourceSpans": [
        {"resource": {"attributes": otlp_json.json_attributes(
            {semconv.SERVICE_NAME: SERVICE, semconv.PROCESS_PID: LANE_PID + lane})},
         "scopeSpans": [{"scope": {"name": SCOPE}, "spans": lane_spans}]}
        for lane, lane_spans in by_lane.items()]}


def _attributes(row: Any) -> dict[str, Any]:
    """A span row's attributes: its request and phase, a read's bytes and reader thread, and
    any the row carries (the chunk ledger's)."""
    attributes: dict[str, Any] = {semconv.REQUEST_ID: row.request_id, semconv.PHASE: row.phase}
    if row.name == semconv.SPAN_STORAGE_READ:
        attributes[semconv.READ_BYTES] = int(row.read_bytes)
        attributes[semconv.READER_TIDS] = [int(row.tid)]
    extra = getattr(row, "attrs", None)
    if isinstance(extra, dict):
        attributes.update(extra)
    return attributes



def _sdk_spans(spans: pd.DataFrame) -> list[ReadableSpan]:
    """One finished SDK span per row; each lane is its own vLLM process (its own resource)."""
    resources = {lane: Resource({semconv.SERVICE_NAME: SERVICE,
                                 semconv.PROCESS_PID: LANE_PID + int(lane)})
                 for lane in spans["lane"].unique()}
    scope = InstrumentationScope(SCOPE)
    flags = TraceFlags(TraceFlags.SAMPLED)
    out = []
    row: Any  # a span row (pandas types its fields as any scalar)
    for row in spans.itertuples(index=False):
        key, number, parent_number = int(row.key), int(row.no), int(row.parent)
        trace_id = int(_trace_id(key), 16)
        attributes = _attributes(row)
        parent = (SpanContext(trace_id, key * 32 + parent_number, False, flags)
                  if parent_number else None)
        out.append(ReadableSpan(
            name=row.name, context=SpanContext(trace_id, key * 32 + number, False, flags),
            parent=parent, resource=resources[row.lane], attributes=attributes,
            kind=SpanKind.INTERNAL, start_time=int(row.start) + OFFSET_NS,
            end_time=int(row.end) + OFFSET_NS, instrumentation_scope=scope))
    return out


def _block_table(plan: pd.DataFrame, io: pd.DataFrame, seed: int) -> pd.DataFrame:
    """The joined reads plus unrelated I/O (another thread's reads, journal writes)."""
    rng = np.random.default_rng(seed + 1)
    noise_n = max(len(plan) // 10, 1) if len(plan) else 0
    at = rng.integers(int(plan["arrival"].min()) if len(plan) else 0,
                      int(plan["finish"].max()) + 1 if len(plan) else 1, noise_n)
    noise = pd.DataFrame({"key": -1, "tid": np.where(np.arange(noise_n) % 2, 77, 99),
                          "start_ns": at, "issue_ns": at + 20_000, "complete_ns": at + 120_000,
                          "bytes": 4096})
    rows = pd.concat([io, noise], ignore_index=True)
    phase_of = plan["phase"].to_numpy()
    return pd.DataFrame({
        "phase": np.where(rows["key"] >= 0, phase_of[rows["key"].clip(lower=0)], phase_of[0]
                          if len(plan) else ""),
        "device": "vda", "dev": "254:0", "sector": rng.integers(0, 1 << 30, len(rows)) * 8,
        "bytes": rows["bytes"].astype(np.int64), "op": np.where(rows["tid"] == 99, "W", "R"),
        "pid": 4242, "tid": rows["tid"].astype(np.int64), "comm": "python3",
        "start_ns": rows["start_ns"].astype(np.int64), "insert_ns": -1,
        "issue_ns": rows["issue_ns"].astype(np.int64),
        "complete_ns": rows["complete_ns"].astype(np.int64), "error": 0,
    })


def _queue_depth(block: pd.DataFrame) -> pd.DataFrame:
    """In-flight count after every issue and completion (what the bpf probe records)."""
    events = pd.DataFrame({
        "phase": np.concatenate([block["phase"], block["phase"]]),
        "ts_ns": np.concatenate([block["issue_ns"], block["complete_ns"]]),
        "delta": np.concatenate([np.ones(len(block), int), -np.ones(len(block), int)]),
    }).sort_values(["ts_ns", "delta"], kind="stable")
    return pd.DataFrame({"phase": events["phase"].astype(str), "ts_ns": events["ts_ns"],
                         "device": "vda", "hw_queue": -1,
                         "inflight": events["delta"].cumsum().astype(np.int64), "source": "bpf"})


def _nvme(block: pd.DataFrame) -> pd.DataFrame:
    """One NVMe command per block request, as an NVMe host would record (synthetic)."""
    return pd.DataFrame({
        "phase": block["phase"], "ctrl_id": 0, "transport": "pcie", "disk": "nvme0n1",
        "qid": 1 + block["tid"] % 4, "cid": np.arange(len(block)) & 0xFFF,
        "opcode": np.where(block["op"] == "R", 2, 1), "nsid": 1, "bytes": block["bytes"],
        "setup_ns": block["issue_ns"], "complete_ns": block["complete_ns"], "status": 0,
    })
