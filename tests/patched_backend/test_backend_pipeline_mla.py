# SPDX-License-Identifier: Apache-2.0
"""No unverified chunk reaches the KV cache on an MLA model (issue 30, N1).

LMCache 0.5.6 turns on ``save_only_first_rank`` for every MLA model, even at TP=1; its
retrieve then copies the got chunks itself (the broadcast to the other ranks, and a substitute
for the connector's source) before the connector's copy. A chunk handed out while its reads
still run would be copied unverified there, so the pipelined transfer must never be on for such
an engine, and a get outside a pipelined retrieve must verify before it returns.

The engine is LMCache's own, in-process, with a DeepSeek-style MLA geometry (one latent vector
of ``kv_lora_rank + qk_rope_head_dim`` = 576 values per token and layer); the connector copies
into a CPU tensor standing in for the paged KV cache (the GPU is what cannot run here).
"""

import os

import pytest
import torch

from kvscope.patched_backend.parallel_disk import lmcache_config
from kvscope.patched_backend.parallel_disk.chunkfile import file_name
from kvscope.patched_backend.parallel_disk.pipelined_connector import PipelinedConnector
from kvscope.patched_backend.vllm_cpu import plugin
from kvscope.testkit.lmcache_harness import CHUNK, MODEL, RecordingSink, flip_payload_byte
from kvscope.testkit.lmcache_harness import lmcache_config as harness_config

LAYERS, LATENT = 3, 512 + 64  # DeepSeek-V2/V3: kv_lora_rank 512, qk_rope_head_dim 64
CHUNKS = 4
SLOW = {"kvscope.queue_depth": 1, "kvscope.read_delay_ms": 150,
        "kvscope.prefetch_on_lookup": False}


def _mla_metadata():
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 1, CHUNK, 1, LATENT), use_mla=True)


def _latent(tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(1, LAYERS, tokens, LATENT, generator=gen).to(torch.bfloat16)


@pytest.fixture
def mla_engines(lmcache_engines):
    """``make(wrap)``: an MLA engine; ``wrap`` turns the copy connector into the engine's."""
    return lambda wrap=lambda inner, config, meta: inner, **knobs: lmcache_engines(
        _mla_metadata(), wrap, **knobs)


def _store_and_corrupt(make, tmp_path, tokens, source, chunk: int) -> str:
    engine, _ = make()
    assert engine.save_only_first_rank  # LMCache's own choice for MLA, the case at issue
    engine.store(tokens, kvbuf=source)
    assert engine.storage_manager.storage_backends["kvscope"].flush(timeout=60)
    names = [file_name(key.to_string())
             for _, _, key in engine.token_database.process_tokens(tokens)]
    path = os.path.join(str(tmp_path / "kv"), names[chunk])
    flip_payload_byte(path, 999)
    return path


def _assert_only_verified_chunks_copied(engine, tokens, source, corrupt: int) -> None:
    backend = engine.storage_manager.storage_backends["kvscope"]
    pool = backend.local_cpu_backend.memory_allocator.pin_allocator
    used_before = pool.total_allocated_size
    target = torch.zeros_like(source)
    hit = engine.retrieve(tokens, kvbuf=target)
    good = corrupt * CHUNK
    # the chunks before the corrupt one are bit-exact; it and the ones after were never copied,
    # and the mask sends their tokens to the engine to recompute
    assert torch.equal(target[:, :, :good], source[:, :, :good])
    assert not target[:, :, good:].any()
    assert hit.tolist() == [True] * good + [False] * (len(tokens) - good)
    assert backend.stats()["corrupt_by_reason"] == {"checksum": 1}
    assert pool.total_allocated_size == used_before  # no pin or reference left behind


def test_an_mla_engine_copies_only_verified_chunks_even_with_the_pipelined_connector(
        mla_engines, tmp_path):
    """Wrapped by hand (or by an older plugin): the backend still verifies before returning,
    because LMCache copies MLA chunks itself before the connector's copy."""
    tokens = torch.arange(CHUNKS * CHUNK)
    source = _latent(len(tokens))
    _store_and_corrupt(mla_engines, tmp_path, tokens, source, chunk=2)
    sink = RecordingSink()
    engine, _ = mla_engines(lambda inner, config, meta: PipelinedConnector(inner, sink), **SLOW)
    _assert_only_verified_chunks_copied(engine, tokens, source, corrupt=2)


def test_the_plugin_leaves_an_mla_engines_connector_unpipelined(mla_engines, tmp_path):
    tokens = torch.arange(CHUNKS * CHUNK)
    source = _latent(len(tokens))
    _store_and_corrupt(mla_engines, tmp_path, tokens, source, chunk=1)
    engine, connector = mla_engines(plugin._pipelined, **SLOW)
    assert not isinstance(connector, PipelinedConnector)
    _assert_only_verified_chunks_copied(engine, tokens, source, corrupt=1)


@pytest.mark.parametrize(("mla", "engine_keys", "extra", "pipelined"), [
    (False, {}, {}, True),
    (True, {}, {}, False),  # LMCache's default for MLA: save_only_first_rank on
    (True, {}, {"save_only_first_rank": "false"}, False),  # truthy to LMCache: still on
    (True, {}, {"save_only_first_rank": False}, True),
    (False, {"use_layerwise": True}, {}, False),
])
def test_the_transfer_is_pipelined_only_where_the_connector_makes_every_copy(
        tmp_path, mla, engine_keys, extra, pipelined):
    config = harness_config(str(tmp_path / "kv"), **engine_keys)
    config.extra_config.update(extra)
    meta = _mla_metadata()
    meta.use_mla = mla
    assert lmcache_config.pipelines_transfer(config, meta) is pipelined
