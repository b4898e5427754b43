# SPDX-License-Identifier: Apache-2.0
"""kvscope's CPU KV connector on real tensors laid out as vLLM-CPU's: whole blocks round trip,
whether a chunk's blocks are consecutive (copied as runs) or scattered."""

import pytest
import torch

from kvscope.patched_backend.vllm_cpu.connector import CPUPagedKVConnector
from kvscope.testkit.lmcache_harness import metadata

BLOCK, LAYERS, HEADS, PACKED = 16, 2, 2, 256


class _Obj:
    def __init__(self, nbytes: int) -> None:
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)


def _caches(blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, HEADS, BLOCK, PACKED, generator=gen).to(torch.bfloat16)
            for _ in range(LAYERS)]


@pytest.mark.parametrize("order", [[4, 5, 6, 7], [9, 2, 3, 0], [1, 3, 5, 7]],
                         ids=["consecutive", "two-runs", "scattered"])
def test_blocks_round_trip_exactly(order):
    tokens = len(order) * BLOCK
    slots = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in order])
    connector = CPUPagedKVConnector.from_metadata(metadata(layers=LAYERS))
    source = _caches(12, seed=1)
    obj = _Obj(LAYERS * len(order) * source[0][0].numel() * 2)
    connector.from_gpu(obj, 0, tokens, kvcaches=source, slot_mapping=slots)
    target = [torch.zeros_like(c) for c in source]
    connector.kvcaches = None
    connector.to_gpu(obj, 0, tokens, kvcaches=target, slot_mapping=slots)
    for src, dst in zip(source, target, strict=True):
        assert torch.equal(dst[order], src[order])
        untouched = [b for b in range(12) if b not in order]
        assert not dst[untouched].any()
