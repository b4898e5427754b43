# SPDX-License-Identifier: Apache-2.0
"""Tail sampling: which requests the exporter process exports, decided once their first token
is out.

Under `OTEL_TRACES_SAMPLER=kvscope_tail` the serving threads record every request (their
sampler is ALWAYS_ON: nobody knows at arrival which request will be slow), and the exporter hands
each record it reads to a TailSampler. A trace's records wait in the sampler until the API
server's FIRST_TOKEN mark gives its TTFT; then the whole trace is kept (errors, chunk misses,
slow requests, the caller's sampled traces, a head-sampled fraction of the rest) or dropped,
and its later records follow that decision as they arrive. A dropped request so costs only its
hot-path records and a moment of the exporter's memory, never an OTLP span.

The exporter reads every ring once per round, and a record written in another process before
the mark may be read one round after it, so a trace is decided at the end of the round after
the one its mark (or, without a first token, its server request span) arrived in.

Pure logic: no I/O, no threads, no clock (the exporter passes the time to `end_round`).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Generic, TypeVar

from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

from kvscope.contract import semconv
from kvscope.contract import span_record as rec
from kvscope.contract import chunk_outcomes

T = TypeVar("T")

# Why a request was kept: the first of these that applies.
ERROR, CHUNK_MISS, SLOW, SLOW_PERCENTILE, WARMING, PARENT, HEAD = (
    "error", "chunk_miss", "slow", "slow_percentile", "warming", "parent", "head")
REASONS = (ERROR, CHUNK_MISS, SLOW, SLOW_PERCENTILE, WARMING, PARENT, HEAD)
# What brought a trace to its decision: its first token, the end of a request that had none,
# MAX_WAIT_S without either, the buffer's bound, the exporter's shutdown.
FIRST_TOKEN, REQUEST_END, TIMEOUT, OVERFLOW, DRAIN = (
    "first_token", "request_end", "timeout", "overflow", "drain")
DECIDED_BY = (FIRST_TOKEN, REQUEST_END, TIMEOUT, OVERFLOW, DRAIN)

PARENT_SAMPLED = "parent_sampled"  # FIRST_TOKEN mark attribute: the caller's sampled flag
WARMING_TTFTS = 20  # below this many TTFTs in the window no percentile means anything: keep
MAX_WAIT_S = 60.0
MAX_BUFFERED = 100_000  # span records waiting for their trace's decision
REMEMBERED = 65536  # decided traces whose late records still follow their decision
LOW_64 = TraceIdRatioBased.TRACE_ID_LIMIT


@dataclass(frozen=True)
class TailRule:
    """What to keep, from OTEL_TRACES_SAMPLER_ARG (tracer.config). None: that rule is off."""

    ttft_ms: float | None = None  # keep TTFT strictly above this
    percentile: float | None = 99.0  # keep TTFT at or above this percentile of the window
    ratio: float = 0.01  # head-sampled fraction of the rest, as TraceIdRatioBased
    window: int = 1000  # how many recent requests' TTFTs the percentile is taken over

    def describe(self) -> str:
        slow = [] if self.ttft_ms is None else [f"TTFT over {self.ttft_ms:g} ms"]
        if self.percentile is not None:
            slow.append(f"TTFT at or above p{self.percentile:g} of the last {self.window}")
        return ", ".join(["keeps errors", "chunk misses", *slow, "caller-sampled traces",
                          f"ratio {self.ratio:g} of the rest"])


class _TtftWindow:
    """The last `size` TTFTs, also kept sorted, so a percentile costs an index, not a sort."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._arrived: deque[int] = deque()
        self._sorted: list[int] = []

    def __len__(self) -> int:
        return len(self._arrived)

    def add(self, ttft_ns: int) -> None:
        if len(self._arrived) == self._size:
            del self._sorted[bisect.bisect_left(self._sorted, self._arrived.popleft())]
        self._arrived.append(ttft_ns)
        bisect.insort(self._sorted, ttft_ns)

    def percentile(self, percent: float) -> int:
        """The nearest-rank percentile: the smallest TTFT with `percent` % of them at or below."""
        rank = math.ceil(percent / 100 * len(self._sorted))
        return self._sorted[max(rank, 1) - 1]


@dataclass(eq=False)
class _Trace(Generic[T]):
    """An undecided trace: its buffered items (with their arrival numbers) and what is known."""

    trace_id: int
    items: list[tuple[int, T]] = field(default_factory=list)
    first_seen_s: float = math.inf  # the end of the round it was first seen in
    ttft_ns: int | None = None
    parent_sampled: bool = False
    error: bool = False
    chunk_miss: bool = False
    armed: bool = False  # its decision is due at the end of this or the next round


# Chunk ledger reasons of a chunk that was stored or meant to be (contract.chunk_outcomes): the
# others (never stored, the partial last chunk, behind a miss, a diverged prefix) are what a new
# prompt meets
LOST_REASONS = frozenset(chunk_outcomes.REASONS) - {
    chunk_outcomes.NEVER_STORED, chunk_outcomes.PARTIAL_CHUNK, chunk_outcomes.BEHIND_MISS,
    chunk_outcomes.DIVERGED}


def _missed_a_chunk(record: rec.SpanRecord) -> bool:
    """A ledger with a chunk the cache had been given and did not serve (refused, evicted, a
    store that failed or had not finished, a load that failed: not the misses of a prompt seen
    for the first time), or a storage read that refused chunks."""
    if record.name == semconv.SPAN_KV_LEDGER:
        reasons: Any = record.attributes.get(semconv.LEDGER_REASON, ())
        return isinstance(reasons, (list, tuple)) and any(
            reason in LOST_REASONS for reason in reasons)
    if record.name == semconv.SPAN_STORAGE_READ:
        failed = record.attributes.get(semconv.READ_FAILED_CHUNKS, 0)
        return isinstance(failed, int) and failed > 0
    return False


class TailSampler(Generic[T]):
    """Keeps or drops every trace's items as a whole; `T` is whatever the exporter exports.

    Counts are exact: every span record added is kept, dropped, or still buffered, and every
    trace decided is counted once in `requests_kept` (by reason) or `requests_dropped`, and
    once in `requests_decided_by`.
    """

    def __init__(self, rule: TailRule, *, max_wait_s: float = MAX_WAIT_S,
                 max_buffered: int = MAX_BUFFERED, remembered: int = REMEMBERED) -> None:
        self.rule = rule
        self._max_wait_s = max_wait_s
        self._max_buffered = max_buffered
        self._remembered = remembered
        self._bound = TraceIdRatioBased.get_bound_for_rate(rule.ratio)
        self._window = _TtftWindow(rule.window)
        self._pending: dict[int, _Trace[T]] = {}  # oldest first
        self._decided: OrderedDict[int, bool] = OrderedDict()  # trace id -> kept, oldest first
        self._due: list[_Trace[T]] = []  # decided at the end of this round
        self._due_next: list[_Trace[T]] = []  # at the end of the next one
        self._new: list[_Trace[T]] = []  # first seen this round
        self._out: list[tuple[int, T]] = []
        self._arrivals = 0
        self._kept = dict.fromkeys(REASONS, 0)
        self._decided_by = dict.fromkeys(DECIDED_BY, 0)
        self._spans = {"spans_added": 0, "spans_kept": 0, "spans_dropped": 0,
                       "spans_buffered": 0, "spans_after_decision": 0}

    def add(self, item: T, record: rec.SpanRecord) -> None:
        """Buffer a span's item until its trace is decided (or keep or drop it now, if it is);
        a FIRST_TOKEN mark starts its trace's decision. Other marks are no trace's."""
        if record.kind == rec.MARK_FIRST_TOKEN:
            self._first_token(record)
        elif record.is_span:
            self._span(item, record)

    def end_round(self, now_s: float) -> list[T]:
        """The kept items to export now, in arrival order, once this round's decisions are
        taken. `now_s`: a monotonic clock in seconds (only differences are used)."""
        for trace in self._due:
            if self._pending.get(trace.trace_id) is trace:
                self._decide(trace, REQUEST_END if trace.ttft_ns is None else FIRST_TOKEN)
        self._due, self._due_next = self._due_next, []
        for trace in self._new:
            trace.first_seen_s = now_s
        self._new = []
        self._time_out(now_s)
        return self._take()

    def drain(self) -> list[T]:
        """Decide every trace left with what is known of it (the exporter is stopping)."""
        for trace in list(self._pending.values()):
            self._decide(trace, DRAIN)
        self._due, self._due_next, self._new = [], [], []
        return self._take()

    def counts(self) -> dict[str, Any]:
        return {"requests_kept": dict(self._kept),
                "requests_dropped": sum(self._decided_by.values()) - sum(self._kept.values()),
                "requests_decided_by": dict(self._decided_by),
                "requests_pending": len(self._pending), **self._spans}

    def _first_token(self, record: rec.SpanRecord) -> None:
        if record.trace_id in self._decided:
            return  # a second request in a caller's trace: the first one decided
        trace = self._trace(record.trace_id)
        ttft_ns = max(record.end_ns - record.start_ns, 0)
        trace.ttft_ns = ttft_ns if trace.ttft_ns is None else max(trace.ttft_ns, ttft_ns)
        trace.parent_sampled |= record.attributes.get(PARENT_SAMPLED) is True
        self._arm(trace)

    def _span(self, item: T, record: rec.SpanRecord) -> None:
        self._spans["spans_added"] += 1
        self._arrivals += 1
        kept = self._decided.get(record.trace_id)
        if kept is not None:
            self._spans["spans_after_decision"] += 1
            self._settle([(self._arrivals, item)], kept)
            return
        trace = self._trace(record.trace_id)
        trace.items.append((self._arrivals, item))
        self._spans["spans_buffered"] += 1
        trace.error |= bool(record.flags & rec.ERROR)
        trace.chunk_miss |= _missed_a_chunk(record)
        if record.name == semconv.SPAN_SERVER_REQUEST:
            self._arm(trace)
        while self._spans["spans_buffered"] > self._max_buffered:
            self._decide(next(iter(self._pending.values())), OVERFLOW)

    def _trace(self, trace_id: int) -> _Trace[T]:
        trace = self._pending.get(trace_id)
        if trace is None:
            trace = self._pending[trace_id] = _Trace(trace_id)
            self._new.append(trace)
        return trace

    def _arm(self, trace: _Trace[T]) -> None:
        if not trace.armed:
            trace.armed = True
            self._due_next.append(trace)

    def _time_out(self, now_s: float) -> None:
        """Decide the traces first seen MAX_WAIT_S ago that nothing has armed (the oldest are
        first in `_pending`, so the scan stops at the first one still young enough)."""
        expired = []
        for trace in self._pending.values():
            if now_s - trace.first_seen_s < self._max_wait_s:
                break
            if not trace.armed:
                expired.append(trace)
        for trace in expired:
            self._decide(trace, TIMEOUT)

    def _decide(self, trace: _Trace[T], by: str) -> None:
        del self._pending[trace.trace_id]
        reason = self._reason(trace)
        if trace.ttft_ns is not None:
            self._window.add(trace.ttft_ns)
        self._decided_by[by] += 1
        if reason is not None:
            self._kept[reason] += 1
        self._decided[trace.trace_id] = reason is not None
        if len(self._decided) > self._remembered:
            self._decided.popitem(last=False)
        self._spans["spans_buffered"] -= len(trace.items)
        self._settle(trace.items, reason is not None)

    def _settle(self, items: list[tuple[int, T]], kept: bool) -> None:
        self._spans["spans_kept" if kept else "spans_dropped"] += len(items)
        if kept:
            self._out.extend(items)

    def _reason(self, trace: _Trace[T]) -> str | None:
        """Why the trace is kept, None to drop it; without a TTFT the TTFT rules do not apply."""
        if trace.error:
            return ERROR
        if trace.chunk_miss:
            return CHUNK_MISS
        slow = None if trace.ttft_ns is None else self._slow(trace.ttft_ns)
        if slow is not None:
            return slow
        if trace.parent_sampled:
            return PARENT
        return HEAD if trace.trace_id & LOW_64 < self._bound else None

    def _slow(self, ttft_ns: int) -> str | None:
        rule = self.rule
        if rule.ttft_ms is not None and ttft_ns > rule.ttft_ms * 1e6:
            return SLOW
        if rule.percentile is None:
            return None
        if len(self._window) < WARMING_TTFTS:
            return WARMING
        return SLOW_PERCENTILE if ttft_ns >= self._window.percentile(rule.percentile) else None

    def _take(self) -> list[T]:
        out, self._out = self._out, []
        out.sort(key=itemgetter(0))
        return [item for _, item in out]
