"""kvscope.tracer.tail_sampling: which traces the exporter keeps, when it decides, and counts
that add up; and OTEL_TRACES_SAMPLER=kvscope_tail's configuration."""

from __future__ import annotations

import logging
import random

import pytest
from opentelemetry.sdk.trace import sampling

from kvscope.contract import semconv
from kvscope.contract import span_record as rec
from kvscope.tracer import config, failsafe
from kvscope.tracer.tail_sampling import LOW_64, TailRule, TailSampler

THRESHOLD = TailRule(ttft_ms=500, percentile=None)  # no warming: one request decides alone
ROUND_S = 0.05


def never_head(n: int) -> int:
    """A trace id whose low 64 bits no ratio below 1 samples."""
    return (n << 64) | (LOW_64 - n)


def span(trace_id: int, name: str = semconv.SPAN_QUEUE, *, flags: int = 0,
         attributes: dict | None = None) -> rec.SpanRecord:
    kind = rec.SERVER if name == semconv.SPAN_SERVER_REQUEST else rec.INTERNAL
    return rec.SpanRecord(name=name, kind=kind, flags=flags, trace_id=trace_id, span_id=1,
                          parent_span_id=0, start_ns=0, end_ns=1, request_id="r",
                          vllm_request_id=None, attributes=attributes or {})


def mark(trace_id: int, ttft_ms: float, **attributes: bool) -> rec.SpanRecord:
    arrival_ns = 5_000_000_000
    return rec.SpanRecord(name=semconv.SPAN_FIRST_TOKEN, kind=rec.MARK_FIRST_TOKEN, flags=0,
                          trace_id=trace_id, span_id=0, parent_span_id=0, start_ns=arrival_ns,
                          end_ns=arrival_ns + int(ttft_ms * 1e6), request_id="r",
                          vllm_request_id=None, attributes=attributes)


def rounds(sampler: TailSampler[str], *batches: list[tuple[str, rec.SpanRecord]]
           ) -> list[list[str]]:
    """Each batch added in one round, as the exporter polls: what each round's end exported."""
    out: list[list[str]] = []
    for batch in batches:
        for item, record in batch:
            sampler.add(item, record)
        out.append(sampler.end_round(len(out) * ROUND_S))
    return out


def request(name: str, trace_id: int, ttft_ms: float) -> list[tuple[str, rec.SpanRecord]]:
    """A request's queue span, its first-token mark and its server request span."""
    return [(f"{name}.queue", span(trace_id)), (f"{name}.mark", mark(trace_id, ttft_ms)),
            (f"{name}.server", span(trace_id, semconv.SPAN_SERVER_REQUEST))]


def test_a_slow_request_is_kept_and_a_fast_one_dropped_with_counts():
    sampler: TailSampler[str] = TailSampler(THRESHOLD)
    out = rounds(sampler, request("slow", never_head(1), 800) + request("fast", never_head(2), 100),
                 [])
    assert out == [[], ["slow.queue", "slow.server"]], "decided a round after the mark"
    counts = sampler.counts()
    assert counts["requests_kept"]["slow"] == 1 and sum(counts["requests_kept"].values()) == 1
    assert counts["requests_dropped"] == 1 and counts["requests_decided_by"]["first_token"] == 2
    assert (counts["spans_added"], counts["spans_kept"], counts["spans_dropped"],
            counts["spans_buffered"]) == (4, 2, 2, 0), "marks are no spans"


def test_the_threshold_and_the_percentile_keep_different_requests():
    sampler: TailSampler[str] = TailSampler(TailRule(ttft_ms=1000, percentile=90, window=100))
    warm = [(str(n), mark(never_head(n), 10 * n)) for n in range(1, 21)]  # 10 .. 200 ms
    tail = [("at_p90", mark(never_head(30), 180)), ("fast", mark(never_head(31), 50)),
            ("over_threshold", mark(never_head(32), 1500))]
    rounds(sampler, warm, tail, [])
    assert sampler.counts()["requests_kept"] == {
        "error": 0, "chunk_miss": 0, "slow": 1, "slow_percentile": 1, "warming": 20,
        "parent": 0, "head": 0}
    assert sampler.counts()["requests_dropped"] == 1


def test_a_request_that_errors_before_its_first_token_is_kept_as_error():
    sampler: TailSampler[str] = TailSampler(THRESHOLD)
    failed = [("failed.queue", span(never_head(1))),
              ("failed.server", span(never_head(1), semconv.SPAN_SERVER_REQUEST,
                                     flags=rec.ERROR))]
    aborted = [("aborted.server", span(never_head(2), semconv.SPAN_SERVER_REQUEST))]
    assert rounds(sampler, failed + aborted, []) == [[], ["failed.queue", "failed.server"]]
    counts = sampler.counts()
    assert counts["requests_kept"]["error"] == 1 and counts["requests_dropped"] == 1
    assert counts["requests_decided_by"]["request_end"] == 2


@pytest.mark.parametrize(("name", "attributes", "kept"), [
    pytest.param(semconv.SPAN_KV_LEDGER, {semconv.LEDGER_TIER: ["disk", "none"],
                                          semconv.LEDGER_REASON: ["", "evicted_disk"]}, True,
                 id="ledger-evicted"),
    pytest.param(semconv.SPAN_KV_LEDGER, {semconv.LEDGER_TIER: ["disk", "none"],
                                          semconv.LEDGER_REASON: ["", "refused"]}, True,
                 id="ledger-refused"),
    pytest.param(semconv.SPAN_KV_LEDGER, {semconv.LEDGER_TIER: ["none", "none"],
                                          semconv.LEDGER_REASON: ["never_stored",
                                                                  "behind_miss"]}, False,
                 id="a-new-prompt"),
    pytest.param(semconv.SPAN_STORAGE_READ, {semconv.READ_FAILED_CHUNKS: 2}, True,
                 id="read-failed"),
    pytest.param(semconv.SPAN_KV_LEDGER, {semconv.LEDGER_TIER: ["cpu", "disk"]}, False,
                 id="all-hits"),
    pytest.param(semconv.SPAN_STORAGE_READ, {semconv.READ_FAILED_CHUNKS: 0}, False,
                 id="read-whole"),
])
def test_a_missed_chunk_keeps_a_fast_request(name, attributes, kept):
    sampler: TailSampler[str] = TailSampler(THRESHOLD)
    trace_id = never_head(7)
    rounds(sampler, [("read", span(trace_id, name, attributes=attributes)),
                     ("mark", mark(trace_id, 20))], [])
    assert sampler.counts()["requests_kept"]["chunk_miss"] == int(kept)
    assert sampler.counts()["requests_dropped"] == int(not kept)


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 1.0])
def test_the_head_ratio_decides_on_the_trace_id_as_the_sdk_does(ratio):
    rng = random.Random(33)
    trace_ids = [rng.getrandbits(128) for _ in range(200)] + [0, LOW_64, never_head(3)]
    decisions = []
    for _ in range(2):
        sampler: TailSampler[int] = TailSampler(TailRule(ratio=ratio, percentile=None))
        batch = [(n, record) for n, trace_id in enumerate(trace_ids)
                 for record in (span(trace_id), mark(trace_id, 1))]
        decisions.append(rounds(sampler, batch, [])[1])
    assert decisions[0] == decisions[1], "the same trace ids, the same decisions"
    sdk = sampling.TraceIdRatioBased(ratio)
    assert decisions[0] == [n for n, trace_id in enumerate(trace_ids) if sdk.should_sample(
        None, trace_id, "x").decision.is_sampled()]
    if ratio in (0.0, 1.0):
        assert len(decisions[0]) == ratio * len(trace_ids), "none or all"


def test_a_sampled_caller_keeps_its_fast_request():
    sampler: TailSampler[str] = TailSampler(THRESHOLD)
    rounds(sampler, [("sampled", span(never_head(1))),
                     ("m", mark(never_head(1), 10, parent_sampled=True)),
                     ("unsampled", span(never_head(2))),
                     ("m", mark(never_head(2), 10, parent_sampled=False))], [])
    assert sampler.counts()["requests_kept"]["parent"] == 1
    assert sampler.counts()["requests_dropped"] == 1


def test_a_record_arriving_after_its_trace_was_decided_follows_the_decision():
    sampler: TailSampler[str] = TailSampler(THRESHOLD)
    slow, fast = never_head(1), never_head(2)
    out = rounds(sampler, [("slow.mark", mark(slow, 900)), ("fast.mark", mark(fast, 9))], [],
                 [("fast.server", span(fast, semconv.SPAN_SERVER_REQUEST)),
                  ("slow.server", span(slow, semconv.SPAN_SERVER_REQUEST))])
    assert out == [[], [], ["slow.server"]]
    counts = sampler.counts()
    assert counts["spans_after_decision"] == 2 and counts["spans_kept"] == 1
    assert counts["spans_dropped"] == 1 and counts["requests_decided_by"]["first_token"] == 2


def test_a_record_one_round_after_the_mark_still_decides_and_leaves_with_its_trace():
    """Another process's ledger, written before the mark, read a round after it: its miss
    still keeps the fast request, and it is exported with the rest of the trace."""
    sampler: TailSampler[str] = TailSampler(THRESHOLD)
    trace_id = never_head(1)
    ledger = span(trace_id, semconv.SPAN_KV_LEDGER, attributes={
        semconv.LEDGER_TIER: ["none"], semconv.LEDGER_REASON: ["load_failed"]})
    out = rounds(sampler, [("queue", span(trace_id)), ("mark", mark(trace_id, 5))],
                 [("ledger", ledger)])
    assert out == [[], ["queue", "ledger"]]
    assert sampler.counts()["requests_kept"]["chunk_miss"] == 1
    assert sampler.counts()["spans_after_decision"] == 0


def test_over_max_buffered_the_oldest_trace_is_decided_early():
    sampler: TailSampler[str] = TailSampler(THRESHOLD, max_buffered=3)
    oldest, newer = never_head(1), never_head(2)
    out = rounds(sampler, [("a1", span(oldest, flags=rec.ERROR)), ("a2", span(oldest)),
                           ("b1", span(newer)), ("b2", span(newer))])
    assert out == [["a1", "a2"]]
    counts = sampler.counts()
    assert counts["requests_decided_by"]["overflow"] == 1 and counts["requests_kept"]["error"] == 1
    assert counts["spans_buffered"] == 2 and counts["requests_pending"] == 1


def test_a_trace_with_neither_first_token_nor_end_is_decided_after_max_wait():
    sampler: TailSampler[str] = TailSampler(THRESHOLD, max_wait_s=60)
    sampler.add("lost", span(never_head(1)))
    sampler.add("failed", span(never_head(2), flags=rec.ERROR))
    assert sampler.end_round(100.0) == [] and sampler.end_round(159.9) == []
    assert sampler.end_round(160.0) == ["failed"]
    counts = sampler.counts()
    assert counts["requests_decided_by"]["timeout"] == 2
    assert counts["requests_kept"]["error"] == 1 and counts["requests_dropped"] == 1


def test_a_forgotten_decision_makes_a_late_record_a_new_trace():
    sampler: TailSampler[str] = TailSampler(THRESHOLD, remembered=2)
    rounds(sampler, [(str(n), mark(never_head(n), 900)) for n in (1, 2, 3)], [])
    sampler.add("late3", span(never_head(3)))
    sampler.add("late1", span(never_head(1)))
    assert sampler.counts()["spans_after_decision"] == 1 and sampler.counts()[
        "spans_buffered"] == 1
    assert sampler.end_round(1.0) == ["late3"]


def test_every_span_added_is_kept_dropped_or_still_buffered():
    rng = random.Random(33)
    rule = TailRule(ttft_ms=800, percentile=50, ratio=0.1, window=50)
    sampler: TailSampler[int] = TailSampler(rule, max_wait_s=1.0, max_buffered=12)
    exported: list[int] = []
    each_in_arrival_order = True
    for round_number in range(60):
        for n in range(rng.randrange(12)):
            trace_id = rng.getrandbits(128) if rng.random() < 0.3 else rng.randrange(1, 25)
            kind = rng.choice(["span", "error", "server", "mark"])
            item = round_number * 100 + n
            if kind == "mark":
                sampler.add(-1, mark(trace_id, rng.uniform(1, 900)))
            else:
                sampler.add(item, span(trace_id, semconv.SPAN_SERVER_REQUEST if kind == "server"
                                       else semconv.SPAN_QUEUE,
                                       flags=rec.ERROR if kind == "error" else 0))
        this_round = sampler.end_round(round_number * 0.1)
        each_in_arrival_order &= this_round == sorted(this_round)
        exported += this_round
        _assert_adds_up(sampler.counts(), exported)
    exported += sampler.drain()
    counts = _assert_adds_up(sampler.counts(), exported)
    assert counts["spans_buffered"] == 0 and counts["requests_pending"] == 0
    assert all(counts["requests_decided_by"].values()), "this stream takes every way there"
    assert -1 not in exported, "marks are never exported"
    assert each_in_arrival_order


def _assert_adds_up(counts: dict, exported: list[int]) -> dict:
    assert counts["spans_added"] == (counts["spans_kept"] + counts["spans_dropped"]
                                     + counts["spans_buffered"])
    assert counts["spans_kept"] == len(exported)
    assert sum(counts["requests_decided_by"].values()) == (
        sum(counts["requests_kept"].values()) + counts["requests_dropped"])
    return counts


def test_kvscope_tail_is_configured_by_its_arg_and_records_every_request(caplog):
    env = {"OTEL_TRACES_SAMPLER": "kvscope_tail",
           "OTEL_TRACES_SAMPLER_ARG": " ttft_ms=500, percentile=none,ratio=0.05,window=200,"}
    with caplog.at_level(logging.WARNING):
        settings = config.load(env)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert failsafe.counts() == {}
    assert settings.tail == TailRule(ttft_ms=500, percentile=None, ratio=0.05, window=200)
    assert settings.sampler() is sampling.ALWAYS_ON, "the exporter decides, not the server"
    assert settings.sampler_text() == ("kvscope_tail (keeps errors, chunk misses, TTFT over "
                                       "500 ms, caller-sampled traces, ratio 0.05 of the rest)")
    assert config.load({"OTEL_TRACES_SAMPLER": "KVSCOPE_TAIL"}).tail == TailRule()
    assert config.load({"OTEL_TRACES_SAMPLER": "traceidratio"}).tail is None
