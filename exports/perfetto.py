# SPDX-License-Identifier: Apache-2.0
"""A run's spans as Chrome trace-event JSON, which Perfetto and chrome://tracing open.

One process per request (named by its request id). Complete (`X`) events must nest on a
thread, so each request's spans are laid on as few thread lanes as keep them nested; storage
reads, which overlap each other, are async (`b`/`e`) events instead. A counter track in
process 0 shows reads and bytes in flight across the run.

Times are µs (the format's unit) since the run's first span, with three decimals: exact to the
nanosecond, so a child that ends within its parent still does in the viewer (absolute epoch or
monotonic µs as a double keep only about 0.25 µs, and an imported run's kv.transfer then ended
after its kv.load). `otherData.time_zero_ns` is that first span's start on the run's clock
(the probes' tables' clock), to line the trace up with them.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from kvscope.contract import semconv

COUNTER_PID = 0


def chrome_trace(spans: pd.DataFrame) -> dict[str, Any]:
    """`{"traceEvents": [...]}` for a spans frame from analysis.load_run (monotonic ns)."""
    if spans.empty:
        raise ValueError("the run has no spans to export (was tracing on? see RUN/spans/)")
    zero = int(spans["start_ns"].min())
    spans = spans.assign(start_ns=spans["start_ns"] - zero, end_ns=spans["end_ns"] - zero)
    events: list[dict[str, Any]] = [_meta(COUNTER_PID, 0, "process_name", "kvscope")]
    order = spans.groupby("request_id")["start_ns"].min().sort_values().index
    for pid, request_id in enumerate(order, start=1):
        own = spans[spans["request_id"] == request_id]
        events.append(_meta(pid, 0, "process_name", str(request_id)))
        is_read = own["name"] == semconv.SPAN_STORAGE_READ
        events += _lane_events(pid, own[~is_read])
        events += _async_events(pid, own[is_read])
    events += _inflight_counter(spans[spans["name"] == semconv.SPAN_STORAGE_READ])
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"time_zero_ns": zero}}


def micros(ns: Any) -> float:
    """`ns` (since time zero) as the format's µs: the double nearest to the exact decimal,
    which a reader rounding µs x 1000 to whole ns (Perfetto does) turns back into `ns` for
    any run shorter than about a day."""
    return int(ns) / 1000


def assign_lanes(starts: list[int], ends: list[int]) -> list[int]:
    """A lane per interval such that intervals sharing a lane nest or are disjoint."""
    order = sorted(range(len(starts)), key=lambda i: (starts[i], -ends[i]))
    stacks: list[list[int]] = []
    lanes = [0] * len(starts)
    for i in order:
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= starts[i]:
                stack.pop()
            if not stack or ends[i] <= stack[-1]:
                break
        else:
            stacks.append([])
            lane = len(stacks) - 1
        stacks[lane].append(ends[i])
        lanes[i] = lane
    return lanes


def _lane_events(pid: int, spans: pd.DataFrame) -> list[dict[str, Any]]:
    lanes = assign_lanes(spans["start_ns"].tolist(), spans["end_ns"].tolist())
    events = [_meta(pid, lane + 1, "thread_name", "spans" if lane == 0 else f"spans {lane + 1}")
              for lane in sorted(set(lanes))]
    starts, ends = spans["start_ns"].to_numpy(), spans["end_ns"].to_numpy()
    for lane, row, start, end in zip(lanes, spans.itertuples(index=False), starts, ends):
        events.append({"name": row.name, "cat": "span", "ph": "X", "pid": pid, "tid": lane + 1,
                       "ts": micros(start), "dur": micros(end - start), "args": _args(row)})
    return events


def _async_events(pid: int, reads: pd.DataFrame) -> list[dict[str, Any]]:
    events = []
    for row in reads.itertuples(index=False):
        common = {"name": row.name, "cat": "storage", "id": f"0x{row.span_id}", "pid": pid,
                  "tid": 0}
        events.append({**common, "ph": "b", "ts": micros(row.start_ns), "args": _args(row)})
        events.append({**common, "ph": "e", "ts": micros(row.end_ns)})
    return events


def _inflight_counter(reads: pd.DataFrame) -> list[dict[str, Any]]:
    """Reads and bytes in flight after every read start or end."""
    nbytes = [int(a.get(semconv.READ_BYTES, 0) or 0) for a in reads["attributes"]]
    changes = sorted([(s, 1, b) for s, b in zip(reads["start_ns"], nbytes)]
                     + [(e, -1, -b) for e, b in zip(reads["end_ns"], nbytes)])
    count = inflight = 0
    events = []
    for ts, step, delta in changes:
        count, inflight = count + step, inflight + delta
        events.append({"name": "storage reads in flight", "ph": "C", "pid": COUNTER_PID,
                       "ts": micros(ts), "args": {"reads": count, "bytes": inflight}})
    return events


def _args(row: Any) -> dict[str, Any]:
    return {"trace_id": row.trace_id, "span_id": row.span_id, **row.attributes}


def _meta(pid: int, tid: int, kind: str, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
