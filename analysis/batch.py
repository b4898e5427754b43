"""Waiting on the batch: what a request's worker did for other requests while it waited.

vLLM runs one step at a time per worker process. In a step, LMCache's synchronous KV load
(`start_load_kv`) retrieves the scheduled requests one after another (each kv.load ->
storage.read + kv.transfer), then one forward runs for the whole batch; the engine takes new
requests only between steps. So a request's first token waits for the other requests' reads,
copies and prefill, and none of its own spans covers that wait. Here, every stretch of a
request's window that no span of its own covers (its component spans, kv.load, kv.store),
from arrival (or from the end of its queue span) to the end of its last worker-side span,
goes to what the same worker process was doing for other requests then: prefill, transfer or
storage read (the attribution's priority among them, union over the other requests, the read
split by the block I/O joined to those reads), or `busy` (only another request's kv.load or
kv.store open: that stays in `other`). docs/analysis.md argues the rule.

A process is (service.name, process.pid) of the span's OTLP resource; a request's worker is
the process of most of its worker-side spans. Spans without a process.pid join no batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from kvscope.analysis import spantable, sweep
from kvscope.contract.semconv import NO_PID
from kvscope.contract import semconv

WORKER_LABEL = {
    semconv.SPAN_PREFILL: "prefill", semconv.SPAN_KV_TRANSFER: "transfer",
    semconv.SPAN_STORAGE_READ: "storage_read", semconv.SPAN_KV_LOAD: "busy",
    semconv.SPAN_KV_STORE: "busy",
}
WORKER_COMPONENTS = ("prefill", "transfer", "storage_read")
PROFILE_LABELS = ("prefill", "transfer", "storage_read", "busy", "device_queue", "device_service")
CLASSES = ("prefill", "transfer", "storage_device_service", "storage_device_queue",
           "storage_software", "busy")
BATCH_FROM = ("arrival", "scheduled")
_CODE = {name: i for i, name in enumerate(PROFILE_LABELS)}
_WORKER_CODE = {name: _CODE[label] for name, label in WORKER_LABEL.items()}


@dataclass(frozen=True)
class Worker:
    """The run's worker-side spans and which worker process each request ran in."""

    spans: pd.DataFrame  # key (-1: request not in requests.parquet), proc, label (code of
    # PROFILE_LABELS), start_ns, end_ns
    proc_of: np.ndarray  # per request: its worker process code, -1 when unknown
    unidentified: np.ndarray  # per request: has worker spans, none of them with a process.pid


@dataclass(frozen=True)
class Profile:
    """Per process, what its worker spans were doing, as contiguous classed segments."""

    bounds: np.ndarray  # process p owns segments bounds[p]:bounds[p + 1]
    start: np.ndarray  # int64 ns per segment, sorted within a process
    length: np.ndarray  # int64 ns per segment
    cls: np.ndarray  # index into CLASSES per segment, -1 when the worker ran no span


def worker_spans(spans: pd.DataFrame, key_of: pd.Series, n: int) -> Worker:
    """Worker-side spans of every request id (known or not), with process codes."""
    picked = spans[spans["name"].isin(list(WORKER_LABEL))]
    key = spantable.mapped(picked["request_id"], key_of).fillna(-1).to_numpy(np.int64)
    has_pid = (picked["pid"] != NO_PID).to_numpy()
    proc = np.full(len(picked), -1, dtype=np.int64)
    proc[has_pid] = picked[has_pid].groupby(["service", "pid"], sort=True).ngroup().to_numpy()
    label = spantable.mapped(picked["name"], _WORKER_CODE).to_numpy(np.int64)
    frame = pd.DataFrame({"key": key, "proc": proc, "label": label,
                          "start_ns": picked["start_ns"].to_numpy(np.int64),
                          "end_ns": picked["end_ns"].to_numpy(np.int64)})
    known = frame[(frame["key"] >= 0) & (frame["proc"] >= 0)]
    counts = known.groupby(["key", "proc"], sort=True).size().reset_index(name="count")
    top = counts.sort_values(["key", "count"], ascending=[True, False], kind="stable")
    top = top.drop_duplicates("key")  # most spans wins; ties: the lower process code
    proc_of = np.full(n, -1, dtype=np.int64)
    proc_of[top["key"].to_numpy()] = top["proc"].to_numpy()
    any_worker = np.bincount(frame.loc[frame["key"] >= 0, "key"], minlength=n) > 0
    return Worker(frame, proc_of, any_worker & (proc_of < 0))


Intervals = tuple[np.ndarray, np.ndarray, np.ndarray]  # key, start ns, end ns


def own_intervals(worker: Worker, arrival: np.ndarray, queue_end: np.ndarray | None
                  ) -> tuple[Intervals, Intervals]:
    """(key, start, end) of each request's own kv.load / kv.store spans, and of the stretch in
    which it may wait on the batch: arrival (or `queue_end`) to its last worker span's end."""
    own = worker.spans[worker.spans["key"] >= 0]
    busy = own[own["label"] == _CODE["busy"]]
    last_end = np.full(len(arrival), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(last_end, own["key"].to_numpy(), own["end_ns"].to_numpy())
    since = arrival if queue_end is None else queue_end
    keys = np.flatnonzero((worker.proc_of >= 0) & (last_end > since))
    return ((busy["key"].to_numpy(), busy["start_ns"].to_numpy(), busy["end_ns"].to_numpy()),
            (keys, since[keys], last_end[keys]))


def profile(worker: Worker, io: pd.DataFrame, priority: tuple[str, ...]) -> Profile:
    """Sweep every process's worker spans (and their reads' block I/O) into classed segments."""
    spans = worker.spans[worker.spans["proc"] >= 0]
    io_proc = worker.proc_of[io["key"].to_numpy(np.int64)]
    io = io[io_proc >= 0]
    io_proc = io_proc[io_proc >= 0]
    code = _CODE
    parts: list[tuple[Any, Any, Any, Any]] = [(spans["proc"].to_numpy(), spans["start_ns"].to_numpy(), spans["end_ns"].to_numpy(),
              spans["label"].to_numpy(np.int64)),
             (io_proc, io["start_ns"].to_numpy(), io["issue_ns"].to_numpy(), code["device_queue"]),
             (io_proc, io["issue_ns"].to_numpy(), io["complete_ns"].to_numpy(),
              code["device_service"])]
    key, start, end, label = (np.concatenate([np.broadcast_to(p[i], len(p[0])) for p in parts])
                              .astype(np.int64) for i in range(4))
    segs = sweep.segments(key, start, end, label, len(PROFILE_LABELS))
    active = segs.active
    cls = np.full(len(segs.key), -1, dtype=np.int64)
    cls[active[:, code["busy"]]] = CLASSES.index("busy")
    for name in [c for c in priority if c in WORKER_COMPONENTS][::-1]:  # lowest first
        on = active[:, code[name]]
        if name != "storage_read":
            cls[on] = CLASSES.index(name)
            continue
        cls[on] = CLASSES.index("storage_software")
        cls[on & active[:, code["device_queue"]]] = CLASSES.index("storage_device_queue")
        cls[on & active[:, code["device_service"]]] = CLASSES.index("storage_device_service")
    n_proc = int(worker.spans["proc"].max()) + 1 if len(worker.spans) else 0
    bounds = np.searchsorted(segs.key, np.arange(n_proc + 1))
    return Profile(bounds, segs.start, segs.length, cls)


def waiting(prof: Profile, key: np.ndarray, start: np.ndarray, length: np.ndarray,
            proc_of: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """Per request and class, ns of the given stretches (key, start, length) in which its
    worker process ran that class of work: the integral of the profile over each stretch."""
    proc = proc_of[key]
    sums = {c: np.zeros(n, dtype=np.float64) for c in CLASSES}
    for p in np.unique(proc[proc >= 0]):
        lo, hi = int(prof.bounds[p]), int(prof.bounds[p + 1])
        mine = proc == p
        if hi == lo:
            continue
        seg_start, seg_len, seg_cls = prof.start[lo:hi], prof.length[lo:hi], prof.cls[lo:hi]
        ends = (start[mine], start[mine] + length[mine])
        at = [np.maximum(np.searchsorted(seg_start, t, side="right") - 1, 0) for t in ends]
        for index, name in enumerate(CLASSES):
            ran = np.where(seg_cls == index, seg_len, 0)
            before = np.cumsum(ran) - ran  # class time in the process before each segment
            upto = [before[a] + np.minimum(np.maximum(t - seg_start[a], 0), ran[a])
                    for t, a in zip(ends, at)]
            sums[name] += np.bincount(key[mine], weights=upto[1] - upto[0], minlength=n)
    # float64 is exact here: every addend and partial sum is an integer below 2**53 ns
    return {c: np.rint(v).astype(np.int64) for c, v in sums.items()}
