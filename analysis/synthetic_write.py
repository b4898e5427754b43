"""Write a synthetic plan (analysis.synthetic) out as a schema-v1 run directory.

Span documents are assembled as text with vectorised string operations rather than through
protobuf objects, so 100k requests (a million spans) take seconds; the loader parses them
back with opentelemetry-proto, which is what checks that they are valid OTLP JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import synthetic
from kvscope import rundir
from tracer import semconv

OFFSET_NS = 1_700_000_000 * 10**9 - 50_000 * 10**9  # epoch = monotonic + this
KV_BYTES_PER_TOKEN = 262_144  # Qwen2.5-32B, bf16
LANE_PID = 20_000  # lane k's spans come from process LANE_PID + k (lanes never share a worker)


def write(path: Path, plan: pd.DataFrame, reads: pd.DataFrame, io: pd.DataFrame, *,
          nvme: bool, seed: int, concurrency: int, phases: tuple[str, ...],
          spans_per_file: int, expected: pd.DataFrame) -> Path:
    """Create the run: manifest, requests, spans, block I/O, queue depth (and NVMe)."""
    rundir.create(path, _manifest(path, plan, seed, concurrency, phases))
    plan = plan.assign(phase=np.asarray(phases)[plan["phase_no"].to_numpy()])
    rundir.append_table(path, "requests", _requests(plan, concurrency))
    _write_spans(path, _spans(plan, reads, io), spans_per_file)
    block = _block_table(plan, io, seed)
    rundir.append_table(path, "block_io", block)
    rundir.append_table(path, "queue_depth", _queue_depth(block))
    if nvme:
        rundir.append_table(path, "nvme_io", _nvme(block))
    expected.to_parquet(path / synthetic.EXPECTED_FILE, index=False)
    return path


def _manifest(path: Path, plan: pd.DataFrame, seed: int, concurrency: int,
              phases: tuple[str, ...]) -> dict[str, Any]:
    by_phase = plan.groupby("phase_no")
    return {
        "run_id": path.name, "created_at": "2026-01-01T00:00:00Z",
        "command": ["analysis.synthetic.make_run"],
        "model": {"twin": "qwen2.5-32b", "num_layers": 64, "num_kv_heads": 8, "head_dim": 128,
                  "dtype": "bfloat16", "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
                  "chunk_tokens": 256, "kv_bytes_per_chunk": 256 * KV_BYTES_PER_TOKEN},
        "backend": {"profile": "synthetic"},
        "workload": {"num_requests": len(plan), "concurrency": [concurrency], "seed": seed,
                     "phases": list(phases)},
        "machine": {"hostname": "synthetic", "disk_device": "vda"},
        "versions": {"kvscope": "synthetic"},
        "clock": {"offset_ns": OFFSET_NS, "uncertainty_ns": 1000},
        "phases": [{"name": phases[p], "concurrency": concurrency,
                    "started_ns": int(g["arrival"].min()), "ended_ns": int(g["finish"].max()),
                    "num_requests": len(g), "num_errors": 0} for p, g in by_phase],
        "probes": {"mode": "synthetic"}, "tracer": {"enabled": True, "exporters": ["synthetic"]},
    }


def _requests(plan: pd.DataFrame, concurrency: int) -> pd.DataFrame:
    n = len(plan)
    return pd.DataFrame({
        "request_id": plan["request_id"].astype(str), "phase": plan["phase"].astype(str),
        "concurrency": concurrency, "prompt_index": plan["prompt_index"].astype(np.int64),
        "trace_id": _trace_ids(plan.index.to_numpy()), "prompt_tokens": 8192,
        "cached_tokens": np.where(plan["hit"], 8192 - 16, 0), "output_tokens": np.full(n, 16),
        "arrival_ns": plan["arrival"], "first_token_ns": plan["first_token"],
        "finish_ns": plan["finish"], "ttft_s": (plan["first_token"] - plan["arrival"]) / 1e9,
        "e2e_s": (plan["finish"] - plan["arrival"]) / 1e9, "status": "ok", "error": "",
    })


def _trace_ids(keys: np.ndarray) -> list[str]:
    return [f"5eed{k:028x}" for k in keys]


def _spans(plan: pd.DataFrame, reads: pd.DataFrame, io: pd.DataFrame) -> pd.DataFrame:
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
    frames = [pd.DataFrame({"key": p.index.to_numpy()[rows], "no": no, "parent": parent,
                            "name": name, "start": np.asarray(start)[rows],
                            "end": np.asarray(end)[rows]})
              for no, parent, name, start, end, rows in table]
    per_read = io.groupby(["key", "tid"]).size()
    read_ios = per_read.reindex(pd.MultiIndex.from_arrays([reads["key"], reads["tid"]]),
                                fill_value=0).to_numpy()
    frames.append(pd.DataFrame({
        "key": reads["key"], "no": 9 + reads["which"], "parent": 7,
        "name": semconv.SPAN_STORAGE_READ, "start": reads["start"], "end": reads["end"],
        "tid": reads["tid"], "read_bytes": read_ios * int(io["bytes"].iloc[0] if len(io) else 0)}))
    spans = pd.concat(frames, ignore_index=True)
    spans["request_id"] = plan["request_id"].to_numpy()[spans["key"].to_numpy()]
    spans["phase"] = plan["phase"].to_numpy()[spans["key"].to_numpy()]
    spans["lane"] = plan["lane"].to_numpy()[spans["key"].to_numpy()]
    return spans.sort_values(["key", "no"], kind="stable").reset_index(drop=True)


def _attributes(spans: pd.DataFrame) -> pd.Series:
    """The OTLP JSON `attributes` array body of every span."""
    def string(key: str, values: pd.Series) -> pd.Series:
        return f'{{"key":"{key}","value":{{"stringValue":"' + values + '"}}'

    def integer(key: str, values: pd.Series) -> pd.Series:
        return f'{{"key":"{key}","value":{{"intValue":"' + values.astype("int64").astype(str) + '"}}'

    text = (string(semconv.REQUEST_ID, spans["request_id"].astype(str)) + ","
            + string(semconv.PHASE, spans["phase"].astype(str)))
    is_read = (spans["name"] == semconv.SPAN_STORAGE_READ).to_numpy()
    reads = spans[is_read]
    extra = ("," + integer(semconv.READ_BYTES, reads["read_bytes"])
             + f',{{"key":"{semconv.READER_TIDS}","value":{{"arrayValue":{{"values":[{{"intValue":"'
             + reads["tid"].astype("int64").astype(str) + '"}]}}}')
    text = text.astype(object)
    text[is_read] = text[is_read] + extra
    return text


def _write_spans(path: Path, spans: pd.DataFrame, per_file: int) -> None:
    keys = spans["key"].to_numpy()
    trace = pd.Series(_trace_ids(keys), dtype=object)
    span_id = pd.Series([f"{k * 32 + n:016x}" for k, n in zip(keys, spans["no"])], dtype=object)
    parent = pd.Series([f"{k * 32 + n:016x}" if n else "" for k, n in zip(keys, spans["parent"])],
                       dtype=object)
    epoch = lambda c: (spans[c].astype("int64") + OFFSET_NS).astype(str).astype(object)  # noqa: E731
    body = ('{"traceId":"' + trace + '","spanId":"' + span_id + '","parentSpanId":"' + parent
            + '","name":"' + spans["name"].astype(object) + '","kind":1,"startTimeUnixNano":"'
            + epoch("start") + '","endTimeUnixNano":"' + epoch("end") + '","attributes":['
            + _attributes(spans) + "]}")
    lanes = spans["lane"].to_numpy()
    for number, first in enumerate(range(0, max(len(body), 1), per_file)):
        chunk, lane = body.iloc[first:first + per_file], lanes[first:first + per_file]
        resources = ",".join(_resource_spans(chunk[lane == k], k) for k in np.unique(lane))
        (path / rundir.SPANS_DIR / f"synthetic-{number:04d}.json").write_text(
            f'{{"resourceSpans":[{resources}]}}')


def _resource_spans(body: pd.Series, lane: int) -> str:
    """One resourceSpans: each lane is its own vLLM process (service.name + process.pid)."""
    resource = json.dumps({"attributes": [
        {"key": "service.name", "value": {"stringValue": "kvscope-synthetic"}},
        {"key": "process.pid", "value": {"intValue": str(LANE_PID + int(lane))}}]})
    return (f'{{"resource":{resource},"scopeSpans":[{{"scope":{{"name":"kvscope.synthetic"}},'
            f'"spans":[{",".join(body)}]}}]}}')


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
