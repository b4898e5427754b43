# SPDX-License-Identifier: Apache-2.0
"""Through a real LMCacheEngine: store, restart the engine, retrieve bit-exact from disk.

The GPU connector is LMCache's MockGPUConnector with its (no-op) copies filled in against a
CPU tensor standing in for the paged GPU KV cache: the only part that cannot run here.
"""

import uuid

import pytest
import torch

from kvscope.testkit.lmcache_harness import CHUNK, copy_connector, lmcache_config, metadata


def _engine(path, **knobs):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    meta = metadata()
    name = f"kvscope-test-{uuid.uuid4().hex[:8]}"
    engine = LMCacheEngineBuilder.get_or_create(
        name, lmcache_config(path, **knobs), meta, copy_connector(meta.kv_shape),
        lambda tensor, src: None, lambda obj, src: obj)
    engine.post_init()
    return name, engine


def _kvbuf(num_tokens, seed):
    from kvscope.testkit.lmcache_harness import HEAD_DIM, HEADS, LAYERS

    gen = torch.Generator().manual_seed(seed)
    # the KV_2LTD layout of LMCache's memory objects: [2, layers, tokens, heads * head_dim]
    return torch.randn(2, LAYERS, num_tokens, HEADS * HEAD_DIM, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("mode", ["parallel", "serial"])
def test_engine_store_restart_retrieve_is_bit_exact(tmp_path, mode):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    tokens = torch.arange(4 * CHUNK)
    source = _kvbuf(len(tokens), seed=3)
    name, engine = _engine(str(tmp_path / "kv"), **{"kvscope.mode": mode})
    try:
        engine.store(tokens, kvbuf=source)
        assert engine.storage_manager.storage_backends["kvscope"].flush(timeout=60)
    finally:
        LMCacheEngineBuilder.destroy(name)
    name, engine = _engine(str(tmp_path / "kv"), **{"kvscope.mode": mode})
    try:
        target = torch.zeros_like(source)
        hit = engine.retrieve(tokens, kvbuf=target)
        assert int(hit.sum()) == len(tokens)
        assert torch.equal(target, source)
    finally:
        LMCacheEngineBuilder.destroy(name)
