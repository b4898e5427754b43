# SPDX-License-Identifier: Apache-2.0
"""The pipelined transfer (handoff.py, pipelined_connector.py) through a real LMCacheEngine.

The wrapped connector copies into a CPU tensor standing in for the paged KV cache (as in
test_backend_engine.py); on vLLM-CPU it is kvscope's block copy, on CUDA LMCache's H2D one,
neither of which changes what is tested here: when each chunk is copied, and what happens when
a chunk fails after it was handed out. vLLM's failed-block list is a recording sink here.
"""

import logging
import os

import pytest
import torch

from kvscope.patched_backend.parallel_disk import handoff
from kvscope.patched_backend.parallel_disk.chunkfile import file_name
from kvscope.patched_backend.parallel_disk.pipelined_connector import PipelinedConnector
from kvscope.testkit.lmcache_harness import (CHUNK, HEAD_DIM, HEADS, LAYERS, RecordingSink,
                                             flip_payload_byte, metadata)

CHUNKS = 4


@pytest.fixture
def engine_factory(lmcache_engines):
    """``make(sink)``: an engine of the test geometry; with a sink, its connector pipelined."""

    def make(sink=None, **knobs):
        def wrap(inner, config, meta):
            return inner if sink is None else PipelinedConnector(inner, sink)

        return lmcache_engines(metadata(), wrap, **knobs)

    return make


def _source(tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    return torch.randn(2, LAYERS, tokens, HEADS * HEAD_DIM, generator=gen).to(torch.bfloat16)


def _stored(engine_factory, tokens: torch.Tensor, source: torch.Tensor) -> list[str]:
    """Store the chunks with a plain engine; their chunk file names in token order."""
    engine, _ = engine_factory()
    engine.store(tokens, kvbuf=source)
    assert engine.storage_manager.storage_backends["kvscope"].flush(timeout=60)
    return [file_name(key.to_string())
            for _, _, key in engine.token_database.process_tokens(tokens)]


# one sub-read at a time, each 150 ms: chunk i is ready ~150 ms after chunk i-1
SLOW = {"kvscope.queue_depth": 1, "kvscope.read_delay_ms": 150,
        "kvscope.prefetch_on_lookup": False}


def test_each_chunk_is_copied_while_later_chunks_are_read(engine_factory, events):
    tokens = torch.arange(CHUNKS * CHUNK)
    source = _source(len(tokens))
    _stored(engine_factory, tokens, source)
    sink = RecordingSink()
    engine, connector = engine_factory(sink, **SLOW)
    target = torch.zeros_like(source)
    hit = engine.retrieve(tokens, kvbuf=target)
    assert int(hit.sum()) == len(tokens) and torch.equal(target, source)
    assert sink.reported == []
    [complete] = events["on_read_complete"]
    assert len(connector.copies) == CHUNKS
    # the first chunk was copied before the last one was read: the transfer overlapped the reads
    assert connector.copies[0][1] < complete.end_ns
    # and the load ended one chunk's copy after the last byte, not a whole request's copy later
    assert connector.copies[-1][0] >= complete.end_ns
    backend = engine.storage_manager.storage_backends["kvscope"]
    stats = backend.stats()
    assert stats["read_hits"] == CHUNKS and stats["corrupt_chunks"] == 0


def test_a_chunk_failing_after_the_handoff_is_never_copied_and_reported(engine_factory, tmp_path):
    tokens = torch.arange(CHUNKS * CHUNK)
    source = _source(len(tokens))
    names = _stored(engine_factory, tokens, source)
    path = os.path.join(str(tmp_path / "kv"), names[2])
    flip_payload_byte(path, 4321)  # one payload byte of chunk 2: its XXH3 fails
    sink = RecordingSink()
    engine, connector = engine_factory(sink, **SLOW)
    backend = engine.storage_manager.storage_backends["kvscope"]
    pool = backend.local_cpu_backend.memory_allocator.pin_allocator
    used_before = pool.total_allocated_size
    target = torch.zeros_like(source)
    engine.retrieve(tokens, kvbuf=target)
    # chunks 0 and 1 are exact, 2 and 3 never touched, and their tokens went to vLLM's list
    assert torch.equal(target[:, :, : 2 * CHUNK], source[:, :, : 2 * CHUNK])
    assert not target[:, :, 2 * CHUNK:].any()
    assert sink.reported == [(2 * CHUNK, CHUNKS * CHUNK)]
    assert len(connector.copies) == 2
    stats = backend.stats()
    assert stats["corrupt_by_reason"] == {"checksum": 1}
    assert stats["read_hits"] == 2 and stats["read_misses"] == 2
    assert os.path.exists(path + ".corrupt")
    assert pool.total_allocated_size == used_before  # every chunk's memory is back


def test_without_a_consumer_the_get_waits_for_every_chunk(engine_factory, events):
    tokens = torch.arange(CHUNKS * CHUNK)
    source = _source(len(tokens))
    _stored(engine_factory, tokens, source)
    engine, connector = engine_factory(None, **SLOW)
    target = torch.zeros_like(source)
    assert int(engine.retrieve(tokens, kvbuf=target).sum()) == len(tokens)
    assert torch.equal(target, source)


def _keys(engine, tokens):
    return [key for _, _, key in engine.token_database.process_tokens(tokens)]


def test_a_get_outside_a_pipelined_retrieve_verifies_before_it_returns(engine_factory, tmp_path):
    """LMCache's move, compression, P2P and layerwise paths get chunks outside a retrieve and
    use their bytes at once: even with a pipelined engine in the process, they get only
    verified chunks (a prefix), never ones still being read."""
    tokens = torch.arange(CHUNKS * CHUNK)
    source = _source(len(tokens))
    names = _stored(engine_factory, tokens, source)
    flip_payload_byte(os.path.join(str(tmp_path / "kv"), names[2]), 4321)
    engine, _ = engine_factory(RecordingSink(), **SLOW)
    objs = engine.storage_manager.batched_get(_keys(engine, tokens), location="kvscope")
    assert objs[2:] == [None, None]
    for i, obj in enumerate(objs[:2]):
        assert torch.equal(obj.tensor, source[:, :, i * CHUNK:(i + 1) * CHUNK])
        obj.ref_count_down()


def test_chunks_handed_out_but_never_taken_are_settled_when_the_pipelined_get_ends(
        engine_factory, tmp_path, caplog):
    """A retrieve that never reaches its connector (it raised, or a later LMCache copied the
    chunks another way) leaves no pin, reference or read behind, and says so."""
    tokens = torch.arange(CHUNKS * CHUNK)
    source = _source(len(tokens))
    _stored(engine_factory, tokens, source)
    engine, _ = engine_factory(RecordingSink(), **SLOW)
    backend = engine.storage_manager.storage_backends["kvscope"]
    pool = backend.local_cpu_backend.memory_allocator.pin_allocator
    used_before = pool.total_allocated_size
    # the backend's package logs through LMCache's handler only; listen on the module itself
    logging.getLogger(handoff.__name__).addHandler(caplog.handler)
    try:
        with handoff.pipelined_get(lambda: True):
            objs = backend.batched_get_blocking(_keys(engine, tokens))
            assert handoff.take(objs[0]) is not None  # handed out while being read
    finally:
        logging.getLogger(handoff.__name__).removeHandler(caplog.handler)
    for obj in objs:
        obj.ref_count_down()  # what LMCache does after its copy
    assert pool.total_allocated_size == used_before
    assert backend.stats()["read_hits"] == CHUNKS
    assert "never taken by its connector" in caplog.text


def test_every_pipelined_connector_of_a_process_shares_one_retrieve_wrapper():
    from lmcache.v1.cache_engine import LMCacheEngine

    from kvscope.patched_backend.parallel_disk.pipelined_connector import _pipelined_retrieve

    for _ in range(3):
        PipelinedConnector(object(), RecordingSink())
    method, ours = vars(LMCacheEngine)["retrieve"], 0
    while hasattr(method, "__wrapped__"):
        ours += getattr(method, "_self_wrapper", None) is _pipelined_retrieve
        method = method.__wrapped__
    assert ours == 1
