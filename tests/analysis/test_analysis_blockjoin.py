"""The block join on hand-made spans and block reads (analysis.blockjoin): by disk location
whatever thread read, by thread and time only for spans that give no location."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa

from kvscope.analysis import blockjoin
from kvscope.contract import semconv
from kvscope.contract import spantable as spec

DISK = "vda"
MS = 1_000_000


def _span(key: int, start: int, end: int, chunks: list[tuple[int, int, list[tuple[int, int]]]],
          tids: list[int] | None = None) -> dict:
    """A storage.read span of request `key`; chunks: (submit, ready, [(first, end) sectors])."""
    attrs: dict = {semconv.READ_DEVICE: DISK, semconv.READ_CHUNK_KEY: [f"c{i}" for i in
                                                                         range(len(chunks))],
                   semconv.READ_CHUNK_SUBMIT_NS: [c[0] for c in chunks],
                   semconv.READ_CHUNK_READY_NS: [c[1] for c in chunks],
                   semconv.READ_EXTENT_CHUNK: [i for i, c in enumerate(chunks) for _ in c[2]],
                   semconv.READ_EXTENT_START: [e[0] for c in chunks for e in c[2]],
                   semconv.READ_EXTENT_END: [e[1] for c in chunks for e in c[2]]}
    if not chunks:
        attrs = {}
    if tids is not None:
        attrs[semconv.READER_TIDS] = tids
    return {"key": key, "start_ns": start, "end_ns": end, "attributes": attrs}


def _io(*reads: tuple[int, int, int, int]) -> pd.DataFrame:
    """Block reads (sector, bytes, tid, start); issue and completion follow the start."""
    return pd.DataFrame([{"phase": "cold", "device": DISK, "op": "R", "sector": s, "bytes": b,
                          "tid": t, "start_ns": at, "issue_ns": at + 10, "complete_ns": at + MS}
                         for s, b, t, at in reads])


def test_read_ahead_of_two_requests_on_one_thread_goes_by_location() -> None:
    # both requests' reads were in flight at once, all issued by thread 7
    reads = pd.DataFrame([_span(0, 0, 9 * MS, [(0, 9 * MS, [(1000, 1100)])], tids=[7]),
                          _span(1, 1 * MS, 8 * MS, [(1 * MS, 8 * MS, [(5000, 5100)])], tids=[7])])
    io = _io((1000, 4096, 7, 2 * MS), (5000, 4096, 7, 3 * MS), (1050, 8192, 7, 4 * MS),
             (5090, 4096, 7, 5 * MS))
    joined = blockjoin.join(reads, io)
    assert joined["key"].to_dict() == {0: 0, 1: 1, 2: 0, 3: 1}
    assert not joined["ambiguous"].any() and set(joined["method"]) == {blockjoin.LOCATION}
    # the same by thread and time: spans of one thread overlap, so each read is ambiguous
    threads = blockjoin.join(reads.assign(attributes=[{semconv.READER_TIDS: [7]}] * 2), io)
    assert threads["ambiguous"].all() and set(threads["key"]) == {1}


def test_an_engine_whose_reads_come_from_other_threads_joins_the_same() -> None:
    reads = pd.DataFrame([_span(0, 0, 9 * MS, [(0, 9 * MS, [(1000, 1100)])]),
                          _span(1, 0, 9 * MS, [(0, 9 * MS, [(2000, 2100)])])])
    io = _io((2000, 4096, 4242, MS), (1000, 4096, 4242, MS))  # one io_uring submitter
    assert blockjoin.join(reads, io)["key"].tolist() == [1, 0]


def test_the_same_sectors_read_again_later_go_to_the_later_read() -> None:
    extent = [(1000, 1100)]
    reads = pd.DataFrame([_span(0, 0, 4 * MS, [(0, 4 * MS, extent)]),
                          _span(1, 10 * MS, 14 * MS, [(10 * MS, 14 * MS, extent)])])
    joined = blockjoin.join(reads, _io((1000, 4096, 1, MS), (1000, 4096, 1, 11 * MS)))
    assert joined["key"].tolist() == [0, 1] and not joined["ambiguous"].any()


def test_the_same_sectors_read_by_two_requests_at_once_are_ambiguous() -> None:
    extent = [(1000, 1100)]
    reads = pd.DataFrame([_span(0, 0, 9 * MS, [(0, 9 * MS, extent)]),
                          _span(1, 1 * MS, 9 * MS, [(1 * MS, 9 * MS, extent)])])
    joined = blockjoin.join(reads, _io((1000, 4096, 1, 2 * MS)))
    assert joined["key"].tolist() == [1] and joined["ambiguous"].all()


def test_a_read_across_two_chunks_of_one_request_is_that_requests() -> None:
    # chunk files next to each other on disk: the scheduler merged reads of both
    reads = pd.DataFrame([_span(3, 0, 9 * MS, [(0, 9 * MS, [(1000, 1100)]),
                                               (0, 9 * MS, [(1100, 1200)])])])
    joined = blockjoin.join(reads, _io((1090, 8192, 1, MS)))
    assert joined["key"].tolist() == [3] and not joined["ambiguous"].any()


def test_reads_elsewhere_on_the_disk_or_outside_the_window_stay_unjoined() -> None:
    reads = pd.DataFrame([_span(0, 10 * MS, 12 * MS, [(10 * MS, 12 * MS, [(1000, 1100)])])])
    io = _io((900, 4096, 1, 11 * MS), (1100, 4096, 1, 11 * MS), (1000, 4096, 1, 1 * MS))
    other_disk = _io((1000, 4096, 1, 11 * MS)).assign(device="nvme0n1")
    assert blockjoin.join(reads, pd.concat([io, other_disk], ignore_index=True)).empty


def test_a_chunk_still_being_read_keeps_its_window_open() -> None:
    reads = pd.DataFrame([_span(0, 0, MS, [(0, -1, [(1000, 1100)])])])  # ready -1: timed out
    assert blockjoin.join(reads, _io((1000, 4096, 1, 50 * MS)))["key"].tolist() == [0]


def test_spans_without_extents_join_by_reader_thread_and_time() -> None:
    reads = pd.DataFrame([_span(0, 0, 5 * MS, [], tids=[7]), _span(1, 0, 5 * MS, [], tids=[8]),
                          _span(2, 0, 5 * MS, [(0, 5 * MS, [(1000, 1100)])], tids=[7])])
    io = _io((9000, 4096, 7, MS), (9100, 4096, 8, MS), (1000, 4096, 7, MS))
    joined = blockjoin.join(reads, io)
    assert joined["key"].tolist() == [0, 1, 2]
    assert joined["method"].tolist() == [blockjoin.THREAD_WINDOW] * 2 + [blockjoin.LOCATION]
    assert blockjoin.joinable(reads).all()
    assert not blockjoin.joinable(pd.DataFrame([_span(0, 0, 1, [])])).any()


def test_typed_attribute_columns_join_as_the_dicts_do() -> None:
    """The span table's typed columns (Arrow lists, a categorical device) join block reads
    exactly as attribute dicts do: by location, by thread, and across two chunks."""
    reads = pd.DataFrame([_span(0, 0, 9 * MS, [(0, 9 * MS, [(1000, 1100)]),
                                               (MS, -1, [(3000, 3010), (4000, 4100)])], tids=[7]),
                          _span(1, 0, 5 * MS, [], tids=[8, 9]), _span(2, 0, 5 * MS, [])])
    io = _io((1000, 4096, 7, 2 * MS), (4050, 8192, 7, 3 * MS), (9100, 4096, 9, MS),
             (3000, 4096, 5, 20 * MS))
    typed = reads.drop(columns="attributes")
    for key, kind in spec.TYPED_ATTRIBUTES.items():
        values = [a.get(key) for a in reads["attributes"]]
        if any(v is not None for v in values):
            typed[key] = (pd.Series(values).astype("category") if kind == pa.string()
                          else pd.Series(values, dtype=pd.ArrowDtype(kind)))
    expected = blockjoin.join(reads, io)
    assert expected["key"].tolist() == [0, 0, 1, 0]
    pd.testing.assert_frame_equal(blockjoin.join(typed, io), expected)
    pd.testing.assert_frame_equal(blockjoin.chunk_extents(typed),
                                  blockjoin.chunk_extents(reads))
    assert (blockjoin.joinable(typed) == [True, True, False]).all()
