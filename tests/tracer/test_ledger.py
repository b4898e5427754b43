"""The chunk ledger's pure part (tracer/ledger.py): bounded memory and each miss reason,
with keys shaped like LMCache's (to_string, chunk_hash) and no LMCache or vLLM running."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvscope.contract import chunk_outcomes
from kvscope.contract import semconv
from kvscope.tracer import ledger
from kvscope.tracer.ledger import Ledger

CHUNK = 256


@dataclass(frozen=True)
class Key:
    chunk_hash: int

    def to_string(self) -> str:
        return f"tiny@1@0@{self.chunk_hash:x}@bfloat16"


def keys(*hashes: int) -> list[Key]:
    return [Key(h) for h in hashes]


def look(led: Ledger, rid: str, ks: list[Key], mapping=None, lengths=None, present=None):
    lengths = lengths or [CHUNK] * len(ks)
    return led.lookup(rid, ks, lengths, mapping or {}, CHUNK, 1, 2, present)


def outcome(record) -> list[tuple[str, str]]:
    return [(c.tier, c.reason) for c in record.chunks]


def test_first_time_prompt_is_never_stored_and_its_short_tail_a_partial_chunk():
    led = Ledger()
    record = look(led, "r1", keys(1, 2, 3), lengths=[CHUNK, CHUNK, 88])
    assert outcome(record) == [("none", chunk_outcomes.NEVER_STORED), ("none", chunk_outcomes.NEVER_STORED),
                               ("none", chunk_outcomes.PARTIAL_CHUNK)]
    assert [(c.start, c.end) for c in record.chunks] == [(0, 256), (256, 512), (512, 600)]
    assert record.chunks[2].detail == "88 of 256 tokens"


def test_hits_by_tier_carry_no_reason():
    led = Ledger()
    ks = keys(1, 2, 3)
    led.stored([ledger.key_text(k) for k in ks], 10)
    record = look(led, "r", ks, {"LocalCPUBackend": ks[:1], "kvscope": ks[1:]})
    assert outcome(record) == [("cpu", ""), ("disk", ""), ("disk", "")]
    assert [c.stored_ns for c in record.chunks] == [10, 10, 10]


def test_store_outcomes_on_the_disk_tier():
    led = Ledger()
    ks = keys(1, 2, 3, 4)
    texts = [ledger.key_text(k) for k in ks]
    look(led, "seen-disk", keys(99), {"kvscope": keys(99)})  # a disk tier is there
    led.stored(texts, 10)
    led.disk_store(texts[1], False, "ENOSPC", "ENOSPC: No space left on device", 20)
    led.disk_store(texts[2], False, "queue_full", "write queue full", 21)
    led.disk_store(texts[3], False, "EIO", "EIO: Input/output error", 22)
    records = [look(led, f"r{i}", [k]) for i, k in enumerate(ks)]
    assert [r.chunks[0].reason for r in records] == [
        chunk_outcomes.STORE_QUEUED, chunk_outcomes.STORE_ENOSPC, chunk_outcomes.STORE_QUEUE_FULL, chunk_outcomes.STORE_ERROR]
    assert records[1].chunks[0].fact_ns == 20
    assert records[1].chunks[0].detail.startswith("ENOSPC")


def test_evicted_refused_and_cpu_evicted_without_disk_copy():
    led = Ledger()
    a, b, c = (ledger.key_text(k) for k in keys(1, 2, 3))
    led.stored([a, b, c], 10)
    led.disk_store(a, True, "", "", 11)
    led.disk_evicted(a, 50, 1 << 20)
    led.disk_store(b, True, "", "", 11)
    led.refused(b, "checksum", 60)
    led.cpu_evicted(c, 70)
    ra, rb, rc = (look(led, k, [Key(h)]) for k, h in (("a", 1), ("b", 2), ("c", 3)))
    assert (ra.chunks[0].reason, ra.chunks[0].fact_ns, ra.chunks[0].detail) == (
        chunk_outcomes.EVICTED_DISK, 50, "capacity 1048576 bytes")
    assert ra.chunks[0].stored_ns == 10
    assert (rb.chunks[0].reason, rb.chunks[0].detail) == (chunk_outcomes.REFUSED, "checksum")
    assert (rc.chunks[0].reason, rc.chunks[0].fact_ns) == (chunk_outcomes.EVICTED_CPU, 70)


def test_the_tier_that_dropped_a_chunk_last_is_its_reason():
    led = Ledger()
    a, b, c = (ledger.key_text(k) for k in keys(1, 2, 3))
    led.stored([a, b, c], 10)
    led.disk_store(a, False, "ENOSPC", "ENOSPC: No space left on device", 11)
    led.cpu_evicted(a, 40)  # CPU only copy, then gone
    led.disk_store(b, True, "", "", 11)
    led.disk_evicted(b, 20, 100)
    led.cpu_evicted(b, 30)  # disk first, CPU last
    led.disk_store(c, True, "", "", 11)
    led.cpu_evicted(c, 30)
    led.disk_evicted(c, 50, 100)  # CPU first, disk last
    ra, rb, rc = (look(led, k, [Key(h)]) for k, h in (("a", 1), ("b", 2), ("c", 3)))
    assert (ra.chunks[0].reason, ra.chunks[0].detail) == (chunk_outcomes.EVICTED_CPU,
                                                          "no disk copy (store_enospc)")
    assert (rb.chunks[0].reason, rb.chunks[0].detail) == (chunk_outcomes.EVICTED_CPU,
                                                          "no disk copy (evicted from disk first)")
    assert (rc.chunks[0].reason, rc.chunks[0].fact_ns) == (chunk_outcomes.EVICTED_DISK, 50)


def test_a_new_store_clears_old_misses():
    led = Ledger()
    a = ledger.key_text(Key(1))
    led.stored([a], 1)
    led.disk_evicted(a, 5, 100)
    led.stored([a], 9)
    led.disk_store(a, True, "", "", 10)
    assert look(led, "r", [Key(1)], {"kvscope": [Key(1)]}).chunks[0].tier == "disk"


def test_divergence_at_the_first_chunk_whose_hash_differs_from_a_stored_sibling():
    led = Ledger()
    first = keys(1, 2, 3)
    look(led, "warm", first)
    led.stored([ledger.key_text(k) for k in first], 10)
    second = keys(1, 7, 8)  # same first chunk, then another continuation
    record = look(led, "diverged", second, {"kvscope": second[:1]})
    assert outcome(record) == [("disk", ""), ("none", chunk_outcomes.DIVERGED), ("none", chunk_outcomes.DIVERGED)]
    assert [c.diverged_at for c in record.chunks] == [-1, 256, 256]
    assert record.chunks[1].detail == "prefix diverged at token 256"


def test_chunks_behind_a_miss_that_a_tier_holds_are_behind_miss():
    led = Ledger()
    ks = keys(1, 2)
    led.stored([ledger.key_text(k) for k in ks], 10)
    led.disk_evicted(ledger.key_text(ks[0]), 20, 100)
    record = look(led, "r", ks, {}, present=lambda key: key == ks[1])
    assert outcome(record) == [("none", chunk_outcomes.EVICTED_DISK), ("none", chunk_outcomes.BEHIND_MISS)]


def test_a_load_that_does_not_serve_a_hit_makes_it_a_miss():
    led = Ledger()
    ks = keys(1, 2, 3)
    texts = [ledger.key_text(k) for k in ks]
    led.stored(texts, 10)
    look(led, "r", ks, {"kvscope": ks})
    led.refused(texts[1], "checksum", 30)
    led.loaded("r", [True] * 256 + [False] * 512)
    record = led.take("r")
    assert outcome(record) == [("disk", ""), ("none", chunk_outcomes.REFUSED), ("none", chunk_outcomes.LOAD_FAILED)]
    assert led.take("r") is None  # written once


def test_memory_is_bounded_and_drops_are_counted():
    led = Ledger(max_keys=8, max_pending=3)
    for i in range(20):
        look(led, f"r{i}", keys(10 * i, 10 * i + 1))
    assert len(led) == 8 and led.pending() == 3
    assert led.dropped == 17
    assert led.take("r19") is not None and led.take("r0") is None


def test_span_attributes_are_one_array_element_per_chunk():
    led = Ledger()
    record = look(led, "r", keys(1, 2), lengths=[CHUNK, 10])
    attrs = ledger.attributes(record, 4)
    assert attrs[semconv.LEDGER_START] == [0, 256] and attrs[semconv.LEDGER_END] == [256, 266]
    assert attrs[semconv.LEDGER_REASON] == [chunk_outcomes.NEVER_STORED, chunk_outcomes.PARTIAL_CHUNK]
    assert attrs[semconv.LEDGER_KEY] == ["0000000000000001", "0000000000000002"]
    assert attrs[semconv.LEDGER_DROPPED] == 4


def test_listener_errors_are_counted_not_raised(monkeypatch):
    from kvscope.tracer import failsafe
    failsafe.reset()
    monkeypatch.setattr(ledger.LEDGER, "disk_store", lambda *a: 1 / 0)

    class Event:
        key, ok, error, end_ns, reason = "k", True, "", 1, ""

    ledger.LedgerListener().on_store(Event())
    assert failsafe.counts() == {"ledger.on_store": 1}
    failsafe.reset()


@pytest.mark.parametrize("backend,tier", [("LocalCPUBackend", "cpu"), ("kvscope", "disk"),
                                          ("LocalDiskBackend", "disk"), ("P2PBackend", "other")])
def test_tiers_by_backend_name(backend, tier):
    assert ledger.tier_of(backend) == tier
