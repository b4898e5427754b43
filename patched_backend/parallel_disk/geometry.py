# SPDX-License-Identifier: Apache-2.0
"""What this engine's chunks look like, to write headers and to refuse foreign chunk files.

A chunk written by another model geometry or dtype must never be served to this engine, even
if its key matched: the scan checks the header against LMCache's metadata (``kv_shape`` is
``(num_layers, 2, chunk_size, num_kv_heads, head_size)``; memory objects are ``KV_2LTD``,
``[2, layers, tokens, kv_heads * head_size]``, or ``[1, ...]`` with MLA), and the physical
layout identity of its bytes against this engine's (layout.py: writer, block size, packing,
model config...), which must be equal.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

from kvscope.patched_backend.parallel_disk.chunkfile import ChunkHeader
from kvscope.patched_backend.parallel_disk.layout import describe_difference, engine_layout


@dataclass(frozen=True)
class EngineGeometry:
    """This engine's model, rank and KV shape; all None when LMCache gave no metadata."""

    model_name: Optional[str] = None
    world_size: Optional[int] = None
    worker_id: Optional[int] = None
    num_layers: Optional[int] = None
    chunk_size: Optional[int] = None
    hidden: Optional[int] = None
    dtype: Optional[str] = None
    layout: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_metadata(cls, metadata: Any) -> "EngineGeometry":
        """From ``LMCacheMetadata`` (None -> no geometry checks) and this engine's layout."""
        if metadata is None:
            return cls(layout=engine_layout(None))
        layers, _, chunk, heads, head_size = metadata.kv_shape
        return cls(metadata.model_name, metadata.world_size, metadata.worker_id, layers, chunk,
                   heads * head_size, str(metadata.kv_dtype), engine_layout(metadata))

    def owns(self, header: ChunkHeader) -> bool:
        """False for chunks of another model or rank sharing the directory (left alone)."""
        if self.model_name is None:
            return True
        parts = header.key.split("@")
        return parts[:3] == [self.model_name, str(self.world_size), str(self.worker_id)]

    def mismatch(self, header: ChunkHeader) -> Optional[tuple[str, str]]:
        """(reason, detail) when a chunk of this model cannot be served here, None when it fits.

        ``foreign``: another geometry or dtype; ``layout``: same geometry, other byte layout.
        """
        if self.num_layers is not None:
            foreign = self._geometry_mismatch(header)
            if foreign:
                return "foreign", foreign
        if header.layout != self.layout:
            return "layout", describe_difference(header.layout, self.layout)
        return None

    def _geometry_mismatch(self, header: ChunkHeader) -> Optional[str]:
        if header.dtype != self.dtype:
            return f"dtype {header.dtype}, engine uses {self.dtype}"
        if len(header.shape) != 4:
            return f"{header.fmt} shape {list(header.shape)} is not [kv, layers, tokens, hidden]"
        _, layers, tokens, hidden = header.shape
        if layers != self.num_layers or hidden != self.hidden:
            return (f"shape {list(header.shape)}: {layers} layers x {hidden} hidden, engine has "
                    f"{self.num_layers} x {self.hidden}")
        if self.chunk_size is not None and tokens > self.chunk_size:
            return f"{tokens} tokens per chunk, engine chunk_size is {self.chunk_size}"
        return None

    def header_for(self, key: Any, obj: Any) -> ChunkHeader:
        """Header of a chunk about to be written (the writer fills in the hashes)."""
        positions = obj.metadata.cached_positions
        geometry = {name: value for name, value in (
            ("num_layers", self.num_layers), ("chunk_size", self.chunk_size),
            ("hidden", self.hidden)) if value is not None}
        return ChunkHeader(
            key=key.to_string(), shape=tuple(obj.get_shape()), dtype=str(obj.get_dtype()),
            fmt=obj.get_memory_format().name, payload_len=obj.get_size(), hash_block=0,
            hashes=(),
            cached_positions=None if positions is None else [int(p) for p in positions.tolist()],
            geometry=geometry, layout=self.layout,
        )
