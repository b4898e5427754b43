"""Runs inside vLLM's worker process (as a worker extension) for the KV round-trip test.

It uses the worker's real KV cache tensors and the real LMCache engine with its connector:
fill some blocks with random bytes, store them through LMCache to disk, load them back into
other blocks, and compare the bytes.
"""

from __future__ import annotations

import time

import torch


class KVRoundTrip:
    def kvscope_kv_roundtrip(self, num_tokens: int, seed: int) -> dict:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        adapter = get_kv_transfer_group()._lmcache_engine
        engine = adapter.lmcache_engine
        caches = list(adapter.kv_caches.values())
        block_size, total_blocks = int(caches[0].shape[2]), int(caches[0].shape[0])
        n = num_tokens // block_size
        src = torch.arange(total_blocks - 2 * n, total_blocks - n)
        dst = torch.arange(total_blocks - n, total_blocks)
        gen = torch.Generator().manual_seed(seed)
        raw = [c.view(c.shape[0], -1).view(torch.uint8) for c in caches]
        for layer in raw:
            layer[src] = torch.randint(0, 256, layer[src].shape, dtype=torch.uint8, generator=gen)
            layer[dst] = 0

        def slots(blocks: torch.Tensor) -> torch.Tensor:
            offsets = torch.arange(block_size).repeat(len(blocks))
            return blocks.repeat_interleave(block_size) * block_size + offsets

        tokens = torch.randint(4, 1000, (num_tokens,), generator=gen)
        engine.store(tokens, kvcaches=caches, slot_mapping=slots(src))
        differs_before = any(not torch.equal(r[src], r[dst]) for r in raw)
        retrieved = 0
        for _ in range(100):  # the disk write is asynchronous: retry until it is readable
            mask = engine.retrieve(tokens, kvcaches=caches, slot_mapping=slots(dst))
            retrieved = int(mask.sum())
            if retrieved == num_tokens:
                break
            time.sleep(0.1)
        return {
            # the KV connector, inside kvscope's pipelined transfer when that wraps it
            "connector": type(getattr(engine.gpu_connector, "inner", engine.gpu_connector)).__name__,
            "pipelined": type(engine.gpu_connector).__name__ == "PipelinedConnector",
            "layer_shape": list(caches[0].shape),
            "block_size": block_size,
            "retrieved": retrieved,
            "differs_before": differs_before,
            "equal_after": all(torch.equal(r[src], r[dst]) for r in raw),
        }

    def kvscope_corrupt_first_chunk(self, token_ids: list[int]) -> str:
        """Flip one payload byte of the chunk file holding the first chunk of `token_ids`: its
        XXH3 check fails when it is next read. Returns the file's path."""
        import os

        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvscope.patched_backend.parallel_disk.chunkfile import HEADER_SIZE, file_name
        from kvscope.patched_backend.parallel_disk import hooks

        engine = get_kv_transfer_group()._lmcache_engine.lmcache_engine
        _, _, key = next(iter(engine.token_database.process_tokens(torch.tensor(token_ids))))
        path = os.path.join(hooks.live_backends()[0].path, file_name(key.to_string()))
        with open(path, "r+b") as f:
            f.seek(HEADER_SIZE + 12345)
            byte = f.read(1)
            f.seek(HEADER_SIZE + 12345)
            f.write(bytes([byte[0] ^ 0xFF]))
        return path

    def kvscope_reported_blocks(self) -> int:
        """Blocks kvscope reported to vLLM as load errors (vllm_cpu/load_errors.py)."""
        from kvscope.patched_backend.vllm_cpu import load_errors

        return load_errors.reported_blocks()

    def kvscope_disk_stats(self) -> dict:
        """Counters of the kvscope disk backend in this worker ({} on the stock backend)."""
        from kvscope.patched_backend.parallel_disk import hooks

        backends = hooks.live_backends()
        return backends[0].stats() if backends else {}
