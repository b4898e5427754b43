# SPDX-License-Identifier: Apache-2.0
"""Every chunk read, and every block read under it, belongs to exactly one request.

Reads ahead at lookup that wait in the backlog are started later on whichever thread frees
budget: a get claiming its own reads (``take``) or a release. That thread is inside another
request's kv.load, yet the read is not that request's: it is the request's that claims it
(issue 14 item 9). 16 requests at once with a backlog, 8 reader threads shared by all: the real
tracer listener (tracer/storage.py) and the real OpenTelemetry SDK; spans go to an in-memory
exporter instead of OTLP (runtime.get replaced).

With the per-I/O probe on this process (root), the block reads of those reads are joined to
requests by where they read on disk (analysis.blockjoin, issue 24 item 5): read-ahead spans of
different requests are open at once on the same reader threads, which a thread-and-time join
cannot tell apart.
"""

import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from kvscope.analysis import blockjoin
from kvscope.contract import semconv
from kvscope.patched_backend.parallel_disk import hooks
from kvscope.patched_backend.parallel_disk.chunkfile import HEADER_SIZE, padded
from kvscope.probes.block import BlockProbe, disk_holding
from kvscope.probes.block_bpf import BlockOptions
from kvscope.testkit.disk import byte_range_sectors
from kvscope.testkit.lmcache_harness import assert_exact, chunk_path
from kvscope.tracer.worker import current
from test_backend_prefetch import CHUNK_BYTES, lookup, settled, unpin, wait_for

REQUESTS, PER_REQUEST = 16, 2
WANTED = {i: [PER_REQUEST * i + j for j in range(PER_REQUEST)] for i in range(REQUESTS)}
KNOBS = {"kvscope.prefetch_bytes": 4 * CHUNK_BYTES, "kvscope.read_unit": "64KiB",
         "kvscope.queue_depth": 8}


def _load_concurrently(h: Any, traced_request: Any, probe: BlockProbe | None = None) -> None:
    """Look every request up (a read-ahead backlog forms), then load all 16 at once in a
    shuffled order, as vLLM's worker does: inside the request's trace and request context."""
    h.put([c for chunks in WANTED.values() for c in chunks])
    if probe is not None:
        probe.start()  # after the writes: only reads from here on
    for i in range(REQUESTS):
        assert lookup(h, WANTED[i]) == PER_REQUEST
    assert h.backend.stats()["prefetch_pending"] == REQUESTS * PER_REQUEST
    order = list(range(REQUESTS))
    random.Random(14).shuffle(order)

    def load(i: int) -> None:
        request = traced_request(i)
        marker = current.set(request)  # what tracer/worker.py sets around the retrieve
        try:
            with hooks.request_context(request.vllm_request_id):
                assert_exact(h.get(WANTED[i]), WANTED[i])
        finally:
            current.reset(marker)
        unpin(h, WANTED[i])

    with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
        list(pool.map(load, order))
    wait_for(lambda: settled(h))
    if probe is not None:
        probe.stop()
    assert h.backend.stats()["prefetch_claimed"] > 0  # reads ahead were claimed (backlog)


@pytest.mark.timeout(300)
def test_16_concurrent_requests_with_a_read_ahead_backlog_each_get_exactly_their_reads(
        harness, exported, traced_request):
    h = harness(**KNOBS)
    _load_concurrently(h, traced_request)
    chunks: dict[str, int] = {}
    for span in exported.get_finished_spans():
        if span.name == semconv.SPAN_STORAGE_READ:
            who = span.attributes[semconv.REQUEST_ID]
            chunks[who] = chunks.get(who, 0) + span.attributes[semconv.READ_CHUNKS]
    assert chunks == {f"req-{i}": PER_REQUEST for i in range(REQUESTS)}, chunks


def _read_spans(exported: Any, drop: tuple[str, ...] = ()) -> pd.DataFrame:
    """The storage.read spans as analysis holds them (key: the request's number)."""
    rows = [(int(s.attributes[semconv.REQUEST_ID].removeprefix("req-")), s.start_time,
             s.end_time, {k: v for k, v in s.attributes.items() if k not in drop})
            for s in exported.get_finished_spans() if s.name == semconv.SPAN_STORAGE_READ]
    return pd.DataFrame(rows, columns=["key", "start_ns", "end_ns", "attributes"])


@pytest.mark.root
@pytest.mark.timeout(300)
def test_each_requests_block_reads_are_exactly_its_own_chunk_reads(
        harness, exported, traced_request, tmp_path: Path):
    h = harness(tmp_path / "kv", **KNOBS)
    probe = BlockProbe(BlockOptions(), pids=[os.getpid()], devices=[disk_holding(tmp_path)])
    _load_concurrently(h, traced_request, probe)
    result = probe.result("cold")
    assert result.lost_events["unfinished_at_stop"] == 0, result.lost_events
    io = result.block_io[result.block_io["op"] == "R"].reset_index(drop=True)
    # whose chunk each block read read, from filefrag (not kvscope's own FIEMAP reader)
    owner_of = {sector: i for i, chunks in WANTED.items() for c in chunks
                for sector in byte_range_sectors(Path(chunk_path(tmp_path / "kv", c)),
                                                 HEADER_SIZE, padded(CHUNK_BYTES))}
    owners = [{owner_of.get(s) for s in range(r.sector, r.sector + r.bytes // 512)}
              for r in io.itertuples()]
    assert all(len(o) == 1 for o in owners)  # no block read spans two requests' chunks
    expected = pd.Series([o.pop() for o in owners]).dropna().astype("int64")
    assert (io.loc[expected.index, "bytes"].groupby(expected).sum()
            == PER_REQUEST * padded(CHUNK_BYTES)).all()  # every byte of every chunk, once
    assert len(expected.unique()) == REQUESTS
    for drop in ((), (semconv.READER_TIDS,)):  # and with no thread to go by (another engine)
        joined = blockjoin.join(_read_spans(exported, drop), io)
        assert not joined["ambiguous"].any() and set(joined["method"]) == {"location"}
        assert joined["key"].sort_index().equals(expected.sort_index())
