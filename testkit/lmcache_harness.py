# SPDX-License-Identifier: Apache-2.0
"""Helpers for the backend tests: a real LMCache StorageManager with the kvscope plugin."""

from typing import Any

import torch

LAYERS, HEADS, HEAD_DIM, CHUNK = 4, 2, 64, 256
MODEL = "kvscope-test-model"


def metadata(layers: int = LAYERS, worker_id: int = 0) -> Any:
    """LMCacheMetadata of the small test geometry (bf16, 256-token chunks)."""
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=MODEL, world_size=1, local_world_size=1, worker_id=worker_id,
        local_worker_id=worker_id, kv_dtype=torch.bfloat16,
        kv_shape=(layers, 2, CHUNK, HEADS, HEAD_DIM),
    )


def lmcache_config(path: str, **knobs: Any) -> Any:
    """LMCacheEngineConfig loading the plugin as ``kvscope`` (no stock disk tier)."""
    from lmcache.v1.config import LMCacheEngineConfig

    engine_keys = {k: knobs.pop(k) for k in list(knobs) if not k.startswith("kvscope.")}
    extra = {
        "storage_plugin.kvscope.module_path": "kvscope.patched_backend.parallel_disk.backend",
        "storage_plugin.kvscope.class_name": "ParallelDiskBackend",
        "kvscope.path": path, "kvscope.capacity": "1GiB",
        # Collapsing each harness's pool costs ~1 s of CPU; test_backend_hugepages.py and the
        # live tests cover it.
        "kvscope.hugepages": False, **knobs,
    }
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.5,
        storage_plugins=["kvscope"], extra_config=extra, **engine_keys,
    )


def key(i: int, worker_id: int = 0) -> Any:
    """Cache key of chunk ``i``."""
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(MODEL, 1, worker_id, 0x1000 + i, torch.bfloat16)


def copy_connector(kv_shape: Any) -> Any:
    """LMCache's MockGPUConnector with its (no-op) copies filled in against a CPU tensor
    standing in for the paged GPU KV cache (``kvbuf=`` in the store / retrieve kwargs)."""
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

    class CopyConnector(MockGPUConnector):
        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                obj.tensor.copy_(kwargs["kvbuf"][:, :, start:end])

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                kwargs["kvbuf"][:, :, start:end].copy_(obj.tensor)

    return CopyConnector(kv_shape)


def kv_tensor(seed: int, layers: int = LAYERS, tokens: int = CHUNK) -> torch.Tensor:
    """Deterministic KV_2LTD chunk ``[2, layers, tokens, heads*head_dim]`` (bf16)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, layers, tokens, HEADS * HEAD_DIM, generator=gen).to(torch.bfloat16)


class Harness:
    """One StorageManager with the plugin; ``put``/``get`` speak in chunk indices."""

    def __init__(self, path: str, layers: int = LAYERS, **knobs: Any) -> None:
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.pin_monitor import PinMonitor
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        config, meta = lmcache_config(path, **knobs), metadata(layers)
        PinMonitor.GetOrCreate(config, meta)  # LMCacheEngine does this; memory pins need it
        self.manager = StorageManager(config, meta, EventManager())
        assert "kvscope" in self.manager.storage_backends, "plugin did not load"
        self.backend = self.manager.storage_backends["kvscope"]
        self.layers = layers

    def put(self, indices: list[int], tokens: int = CHUNK, flush: bool = True,
            location: str | None = "kvscope") -> None:
        """Store chunks ``indices`` in ``location`` (None: every backend, as LMCache's store)."""
        objs = []
        for i in indices:
            data = kv_tensor(i, layers=self.layers, tokens=tokens)
            obj = self.manager.allocate(data.shape, data.dtype)
            obj.tensor.copy_(data)
            objs.append(obj)
        self.manager.batched_put([key(i) for i in indices], objs, location=location)
        if flush:
            assert self.backend.flush(timeout=60)

    def get(self, indices: list[int]) -> list[Any]:
        return self.manager.batched_get([key(i) for i in indices], location="kvscope")

    def close(self) -> None:
        self.manager.close()


def assert_exact(objs: list[Any], indices: list[int], tokens: int = CHUNK,
                 layers: int = LAYERS) -> None:
    """Every object holds exactly the KV written for its index; releases them."""
    assert len(objs) == len(indices)
    for obj, i in zip(objs, indices, strict=True):
        assert obj is not None, f"chunk {i} missing"
        expected = kv_tensor(i, layers=layers, tokens=tokens)
        assert torch.equal(obj.tensor, expected), f"chunk {i} differs"
        obj.ref_count_down()


def chunk_path(directory: Any, i: int) -> str:
    """Path of chunk ``i``'s file under ``directory``."""
    import os

    from kvscope.patched_backend.parallel_disk.chunkfile import file_name

    return os.path.join(str(directory), file_name(key(i).to_string()))


class RecordingSink:
    """A load-error sink (handoff.LoadErrorSink) that keeps the token ranges reported to it,
    standing in for vLLM's failed-block list."""

    def __init__(self) -> None:
        self.reported: list[tuple[int, int]] = []

    def __call__(self, kwargs: dict, start: int, end: int) -> bool:
        self.reported.append((start, end))
        return True


def flip_payload_byte(path: Any, offset: int) -> None:
    """Flip one byte of a chunk file's payload (`offset` past its header): its XXH3 fails."""
    from kvscope.patched_backend.parallel_disk.chunkfile import HEADER_SIZE

    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + offset)
        byte = f.read(1)
        f.seek(HEADER_SIZE + offset)
        f.write(bytes([byte[0] ^ 0xFF]))
