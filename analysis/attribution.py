"""Per-request TTFT attribution: exact exclusive time per component by a priority sweep.

Each request's window is [arrival_ns, first_token_ns]: the client's (so TTFT is what the user
saw), or, for a request only the server saw, its server request span's start to its first
token (analysis.server_requests; column `window`). Inside it, every elementary stretch of
time goes to exactly one component: the highest-priority component whose span is open then
(DEFAULT_PRIORITY; the priority order is argued in docs/analysis.md), or `other` when none is. The components therefore sum to TTFT exactly. Time a lower-priority span was
open under a higher one is `hidden_<component>_ns` (overlap, not lost). Storage-read time is
split the same way by the request's joined block I/O: device service (issue -> complete) over
device queue (submit -> issue) over software (everything else in the read).

Batch-aware: time no span of the request's own covers, while the same vLLM worker process ran
other requests' reads, copies or prefill (analysis.batch), goes to those components as well,
and the `batch_<component>_ns` columns say how much of each component that is.
docs/analysis.md describes the method and every output column.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvscope.analysis import (batch, blockjoin, diagnostics, ledger, server_requests,
                              spantable, sweep)
from kvscope.analysis.run import Run
from kvscope.contract import semconv
from kvscope.contract.chunk_outcomes import TOKEN_COLUMNS

COMPONENTS = ("queueing", "kv_lookup", "storage_read", "transfer", "prefill", "other")
STORAGE_PARTS = ("storage_device_queue", "storage_device_service", "storage_software")
DEFAULT_PRIORITY = ("prefill", "transfer", "storage_read", "kv_lookup", "queueing")
SPAN_COMPONENT = {
    semconv.SPAN_QUEUE: "queueing", semconv.SPAN_KV_LOOKUP: "kv_lookup",
    semconv.SPAN_STORAGE_READ: "storage_read", semconv.SPAN_KV_TRANSFER: "transfer",
    semconv.SPAN_PREFILL: "prefill",
}
WAIT_COMPONENTS = ("storage_read", "transfer", "prefill")  # what waiting on the batch can be
BATCH_PARTS = ("batch_storage_read", "batch_transfer", "batch_prefill", "batch_other")
LABELS = ("window", *DEFAULT_PRIORITY[::-1], "device_queue", "device_service", "own_busy",
          "may_wait")
CODE = {name: i for i, name in enumerate(LABELS)}
_SPAN_CODE = {name: CODE[component] for name, component in SPAN_COMPONENT.items()}
ID_COLUMNS = ("request_id", "phase", "concurrency", "prompt_index", "window")
NS_COLUMNS = (
    "ttft_ns", *(f"{c}_ns" for c in COMPONENTS), *(f"{c}_ns" for c in STORAGE_PARTS),
    *(f"hidden_{c}_ns" for c in DEFAULT_PRIORITY[::-1]), *(f"{c}_ns" for c in BATCH_PARTS),
)
COLUMNS = (*ID_COLUMNS, *NS_COLUMNS, "read_bytes", "block_io_count", *TOKEN_COLUMNS, "partial",
           "diagnostics")
DEFAULT_SKEW_TOLERANCE_NS = 1_000_000


def attribute(run: Run, *, priority: tuple[str, ...] = DEFAULT_PRIORITY,
              skew_tolerance_ns: int = DEFAULT_SKEW_TOLERANCE_NS,
              batch_from: str = "arrival") -> pd.DataFrame:
    """One row per request of `run` (COLUMNS); failed requests have <NA> times.

    Args:
        priority: the five span components, highest first; the rest of the window is `other`.
        skew_tolerance_ns: how far a span may reach outside its request's window before the
            request is flagged as having skewed clocks (the excess is clipped either way).
        batch_from: "arrival" (default) or "scheduled": from when uncovered time may be spent
            waiting on other requests of the same worker (after the queue span ends, if
            "scheduled"); docs/analysis.md says why arrival is the default.
    """
    return attribute_tables(run.requests, run.spans, run.block_io, run.request_notes,
                            have_block_io=not run.block_io.empty, priority=priority,
                            skew_tolerance_ns=skew_tolerance_ns, batch_from=batch_from)


def attribute_tables(requests: pd.DataFrame, all_spans: pd.DataFrame, block_io: pd.DataFrame,
                     request_notes: dict[str, list[str]], *, have_block_io: bool,
                     priority: tuple[str, ...] = DEFAULT_PRIORITY,
                     skew_tolerance_ns: int = DEFAULT_SKEW_TOLERANCE_NS,
                     batch_from: str = "arrival") -> pd.DataFrame:
    """attribute() of a run given as its tables: the one computation every caller runs, on a
    whole run or on a slice of one (analysis.slices). `all_spans` has an attribute dict per span
    or the typed attribute columns of contract.spantable; `have_block_io`: the run recorded
    block I/O at all (a slice of it may hold none)."""
    if sorted(priority) != sorted(DEFAULT_PRIORITY):
        raise ValueError(f"priority must order exactly {sorted(DEFAULT_PRIORITY)}, got {priority}")
    if batch_from not in batch.BATCH_FROM:
        raise ValueError(f"batch_from must be one of {batch.BATCH_FROM}, got {batch_from!r}")
    requests = requests.reset_index(drop=True)
    if "window" not in requests:  # a Run built by hand, not by load_run
        requests = requests.assign(window=server_requests.CLIENT)
    n = len(requests)
    key_of = _key_of(requests)
    spans = _labelled_spans(all_spans, key_of)
    worker = batch.worker_spans(all_spans, key_of, n)
    reads = spans[spans["label"] == CODE["storage_read"]]
    io = blockjoin.join(reads, block_io)
    arrival = requests["arrival_ns"].to_numpy(np.int64)
    first = requests["first_token_ns"].to_numpy(np.int64)
    queue_end = None if batch_from == "arrival" else _queue_end(spans, n)
    own_busy, may_wait = batch.own_intervals(worker, arrival, queue_end)
    intervals = _intervals(n, arrival, first, spans, io, own_busy, may_wait)
    outside = _outside(spans, arrival, first, n)
    starts = np.maximum(intervals["start"], arrival[intervals["key"]])
    ends = np.minimum(intervals["end"], first[intervals["key"]])
    segs = sweep.segments(intervals["key"], starts, ends, intervals["label"], len(LABELS))
    out = _components(segs, n, priority)
    _add_batch(out, segs, batch.profile(worker, io, priority), worker.proc_of, n)
    frame = _frame(requests, out, spans, io)
    tokens = ledger.per_request(ledger.table(all_spans), requests["request_id"])
    frame[list(TOKEN_COLUMNS)] = tokens.to_numpy()
    facts = diagnostics.Facts(requests, spans, reads, blockjoin.joinable(reads), io, outside,
                              request_notes,
                              worker.unidentified)
    frame["partial"], frame["diagnostics"] = diagnostics.describe(facts, skew_tolerance_ns,
                                                                  have_block_io)
    return frame


def _key_of(requests: pd.DataFrame) -> pd.Series:
    """request_id -> row position (the first, where an id repeats)."""
    ids = requests["request_id"].astype(str)
    return pd.Series(np.arange(len(ids)), index=ids)[~ids.duplicated().to_numpy()]


def _labelled_spans(spans: pd.DataFrame, key_of: pd.Series) -> pd.DataFrame:
    """The component spans with their request's key and label code (others dropped)."""
    label = spantable.mapped(spans["name"], _SPAN_CODE)
    key = spantable.mapped(spans["request_id"], key_of)
    kept = spans[label.notna() & key.notna()].copy()
    kept["key"] = key[kept.index].astype("int64")
    kept["label"] = label[kept.index].astype("int64")
    return kept.reset_index(drop=True)


def _queue_end(spans: pd.DataFrame, n: int) -> np.ndarray:
    """Per request, the end of its last queue span (int64 max when it has none)."""
    queue = spans[spans["label"] == CODE["queueing"]]
    end = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    has = np.zeros(n, dtype=bool)
    has[queue["key"].to_numpy()] = True
    end[has] = np.iinfo(np.int64).min
    np.maximum.at(end, queue["key"].to_numpy(), queue["end_ns"].to_numpy())
    return end


def _intervals(n: int, arrival: np.ndarray, first: np.ndarray, spans: pd.DataFrame,
               io: pd.DataFrame, own_busy: batch.Intervals,
               may_wait: batch.Intervals) -> dict[str, np.ndarray]:
    """Every labelled interval as flat arrays: windows, component spans, device queue/service,
    own kv.load/kv.store, and the stretch in which the request may wait on its batch."""
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | int]] = [
        (np.arange(n), arrival, first, CODE["window"]),
        (spans["key"].to_numpy(), spans["start_ns"].to_numpy(), spans["end_ns"].to_numpy(),
         spans["label"].to_numpy()),
        (io["key"].to_numpy(), io["start_ns"].to_numpy(), io["issue_ns"].to_numpy(),
         CODE["device_queue"]),
        (io["key"].to_numpy(), io["issue_ns"].to_numpy(), io["complete_ns"].to_numpy(),
         CODE["device_service"]),
        (*own_busy, CODE["own_busy"]),
        (*may_wait, CODE["may_wait"]),
    ]
    key = np.concatenate([p[0] for p in parts]).astype(np.int64)
    label = np.concatenate([np.broadcast_to(p[3], len(p[0])) for p in parts]).astype(np.int64)
    start = np.concatenate([p[1] for p in parts]).astype(np.int64)
    end = np.concatenate([p[2] for p in parts]).astype(np.int64)
    return {"key": key, "start": start, "end": end, "label": label}


def _outside(spans: pd.DataFrame, arrival: np.ndarray, first: np.ndarray, n: int) -> np.ndarray:
    """Per request, the most any of its component spans reaches outside its window (ns)."""
    key = spans["key"].to_numpy()
    before = arrival[key] - spans["start_ns"].to_numpy()
    after = spans["end_ns"].to_numpy() - first[key]
    reach = np.maximum(np.maximum(before, after), 0)
    out = np.zeros(n, dtype=np.int64)
    np.maximum.at(out, key, reach)
    return out


def _components(segs: sweep.Segments, n: int, priority: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Exposed, hidden and storage-split ns per request from the swept segments."""
    inside = segs.active[:, CODE["window"]]
    winner = np.full(len(segs.key), -1, dtype=np.int64)
    for name in priority[::-1]:  # lowest first, so higher priorities overwrite
        winner[segs.active[:, CODE[name]]] = CODE[name]
    out = {"ttft": sweep.per_key_sum(segs.key, segs.length, inside, n)}
    out["other"] = sweep.per_key_sum(segs.key, segs.length, inside & (winner < 0), n)
    for name in DEFAULT_PRIORITY:
        won = inside & (winner == CODE[name])
        covered = inside & segs.active[:, CODE[name]]
        out[name] = sweep.per_key_sum(segs.key, segs.length, won, n)
        out[f"hidden_{name}"] = sweep.per_key_sum(segs.key, segs.length, covered & ~won, n)
    storage = inside & (winner == CODE["storage_read"])
    service = storage & segs.active[:, CODE["device_service"]]
    queue = storage & ~service & segs.active[:, CODE["device_queue"]]
    out["storage_device_service"] = sweep.per_key_sum(segs.key, segs.length, service, n)
    out["storage_device_queue"] = sweep.per_key_sum(segs.key, segs.length, queue, n)
    out["storage_software"] = (out["storage_read"] - out["storage_device_service"]
                               - out["storage_device_queue"])
    return out


def _add_batch(out: dict[str, np.ndarray], segs: sweep.Segments, prof: batch.Profile,
               proc_of: np.ndarray, n: int) -> None:
    """Move the `other` time spent waiting on the same worker's other requests into their
    components (in place); `batch_<component>` records how much moved."""
    inside = segs.active[:, CODE["window"]]
    own = segs.active[:, [CODE[c] for c in DEFAULT_PRIORITY] + [CODE["own_busy"]]].any(axis=1)
    gap = inside & ~own & segs.active[:, CODE["may_wait"]]
    ran = batch.waiting(prof, segs.key[gap], segs.start[gap], segs.length[gap], proc_of, n)
    out["batch_storage_read"] = (ran["storage_device_service"] + ran["storage_device_queue"]
                                 + ran["storage_software"])
    for name in ("storage_device_service", "storage_device_queue", "storage_software"):
        out[name] = out[name] + ran[name]
    for name in ("transfer", "prefill"):
        out[f"batch_{name}"] = ran[name]
    for name in WAIT_COMPONENTS:
        out[name] = out[name] + out[f"batch_{name}"]
        out["other"] = out["other"] - out[f"batch_{name}"]
    out["batch_other"] = ran["busy"]


def _frame(requests: pd.DataFrame, out: dict[str, np.ndarray], spans: pd.DataFrame,
           io: pd.DataFrame) -> pd.DataFrame:
    """The output table; rows of failed requests get <NA> in every time column."""
    n = len(requests)
    frame = requests[list(ID_COLUMNS)].copy()
    failed = ~diagnostics.succeeded(requests)
    for column in NS_COLUMNS:
        values = pd.array(out[column.removesuffix("_ns")], dtype="Int64")
        values[failed] = pd.NA
        frame[column] = values
    reads = spans[spans["label"] == CODE["storage_read"]]
    read_bytes = spantable.arrow(reads, semconv.READ_BYTES).fill_null(0).to_numpy()
    frame["read_bytes"] = np.bincount(reads["key"].to_numpy(), weights=read_bytes,
                                      minlength=n).astype(np.int64)
    frame["block_io_count"] = np.bincount(io["key"].to_numpy(), minlength=n).astype(np.int64)
    return frame
