"""The shared-memory ring the serving threads write span records into, read back as the
exporter process reads it (a second mapping of the same memfd)."""

from __future__ import annotations

import marshal
import os
import struct
import tempfile

import pytest

from kvscope.contract import span_record as rec
from kvscope.tracer.span_ring import CONTROL, MIN_CAPACITY, READER_AT, Ring, RingError

VALUES = marshal.dumps(("r1", "cmpl-r1-0-0123abcd", {"kvscope.prefill.tokens": 7}, None))


def _pair(capacity: int = MIN_CAPACITY) -> tuple[Ring, Ring]:
    writer = Ring.create(capacity)
    return writer, Ring.attach(os.dup(writer.fd))


def _put(ring: Ring, i: int, values: bytes = VALUES) -> bool:
    return ring.put(rec.NAME_INDEX["kvscope.prefill"], rec.INTERNAL, rec.PARENT_REMOTE,
                    (0xABC << 64) | i, i + 1, 0x77, 1_000 + i, 2_000 + i, values)


def test_records_come_back_whole_in_order_across_many_wraps():
    writer, reader = _pair()
    seen = []
    for i in range(5_000):
        while not _put(writer, i):  # full: the reader catches up, as the exporter would
            records, stuck = reader.read(1_000)
            assert not stuck
            reader.commit(len(records))
            seen += records
    records, _ = reader.read(100_000)
    reader.commit(len(records))
    seen += records
    assert [r.span_id for r in seen] == [i + 1 for i in range(5_000)]
    last = seen[-1]
    assert (last.name, last.trace_id, last.parent_span_id, last.start_ns, last.end_ns) == (
        "kvscope.prefill", (0xABC << 64) | 4_999, 0x77, 5_999, 6_999)
    assert (last.request_id, last.vllm_request_id, dict(last.attributes)) == (
        "r1", "cmpl-r1-0-0123abcd", {"kvscope.prefill.tokens": 7})
    written, dropped, taken = reader.counts()
    assert written == taken == 5_000 and dropped > 0, "each retry after a drop is counted"


def test_a_full_ring_drops_and_counts_instead_of_waiting():
    writer, reader = _pair()
    results = [_put(writer, i) for i in range(2_000)]
    assert results.count(False) > 0 and results[0]
    written, dropped, _ = reader.counts()
    assert (written, dropped) == (results.count(True), results.count(False))
    records, _ = reader.read(100_000)
    assert len(records) == written


def test_a_record_too_large_for_the_ring_is_dropped_not_written():
    writer, reader = _pair()
    assert not _put(writer, 0, b"x" * MIN_CAPACITY)
    assert reader.counts()[:2] == (0, 1)


def test_a_record_whose_bytes_do_not_check_is_not_read_until_they_do():
    """What a reader sees on a CPU that shows the head before the record's bytes."""
    writer, reader = _pair()
    _put(writer, 0)
    _put(writer, 1)
    second = CONTROL + rec.padded(rec.HEADER.size + len(VALUES))
    value_at = second + rec.HEADER.size
    original = writer.memory[value_at]
    writer.memory[value_at] = original ^ 0xFF
    records, stuck = reader.read(10)
    assert [r.span_id for r in records] == [1] and stuck
    reader.commit(len(records))
    writer.memory[value_at] = original
    records, stuck = reader.read(10)
    assert [r.span_id for r in records] == [2] and not stuck


def test_a_head_no_writer_could_publish_reads_nothing():
    writer, reader = _pair()
    _put(writer, 0)
    struct.pack_into("<Q", writer.memory, 16, 10 * MIN_CAPACITY)
    assert reader.read(10) == ([], True)


@pytest.mark.parametrize("make", ["file", "pipe", "small", "magic"])
def test_a_descriptor_that_is_not_a_ring_is_refused(make):
    if make == "pipe":
        fd, other = os.pipe()
        os.close(other)
    else:
        fd, path = tempfile.mkstemp()
        os.unlink(path)
        size = {"file": CONTROL + MIN_CAPACITY, "small": 100, "magic": CONTROL + MIN_CAPACITY}
        os.ftruncate(fd, size[make])
        if make == "file":
            os.pwrite(fd, struct.pack("<QQ", 0x6B7673636F706531, MIN_CAPACITY * 2), 0)
    try:
        with pytest.raises(RingError, match="not a span ring"):
            Ring.attach(fd)
    finally:
        os.close(fd)


def test_the_readers_tail_frees_room_for_the_writer():
    writer, reader = _pair()
    count = 0
    while _put(writer, count):
        count += 1
    records, _ = reader.read(count)
    reader.commit(len(records))
    assert struct.unpack_from("<QQ", writer.memory, READER_AT)[1] == count
    assert _put(writer, count)
