# SPDX-License-Identifier: Apache-2.0
"""The physical layout identity of the KV bytes in a chunk: what a reader must match exactly.

Why: the bytes of a chunk are whatever the KV connector copied out of the engine. kvscope's
CPU connector (``patched_backend/vllm_cpu/connector.py``) copies raw vLLM-CPU blocks, whose byte
order depends on vLLM's ``--block-size`` and on the CPU attention kernel's packing (chosen by
block size, dtype and head size), not LMCache's ``KV_2LTD``. Geometry (layers, hidden, dtype)
alone then matches a chunk written with ``--block-size 128`` to an engine using 32, and serves
wrong KV with a valid checksum. Every chunk records this identity and is served only to an
engine whose identity is equal, field for field (anything else is a miss, reason ``layout``).

The identity is known when the backend is built: the connector registers itself
(``register_writer``) before LMCache creates its storage backends, and vLLM's current config
(set around the worker's KV cache initialisation) gives block size, cache dtype and model.
"""

import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Optional

from kvscope.contract import upstream


@dataclass(frozen=True)
class Writer:
    """Who produced the payload bytes and which version of its byte layout."""

    name: str
    version: int


# LMCache's own connectors write its canonical KV_2LTD tensors.
LMCACHE_KV2LTD = Writer("lmcache-kv2ltd", 1)
# kvscope's CPU connector: whole vLLM-CPU blocks as opaque bytes, layer-major.
CPU_BLOCKS = Writer("kvscope-cpu-blocks", 1)

_lock = threading.Lock()
_writer: Optional[Writer] = None


def register_writer(writer: Optional[Writer]) -> None:
    """The KV connector of this process says what its bytes are (call before the backend);
    None goes back to LMCache's canonical layout."""
    global _writer
    with _lock:
        _writer = writer


def current_writer() -> Writer:
    """The registered writer, LMCache's canonical layout when none registered."""
    with _lock:
        return _writer or LMCACHE_KV2LTD


def engine_layout(metadata: Any, vllm_config: Any = None) -> dict[str, Any]:
    """This engine's layout identity: JSON-able scalars and lists, compared with ``==``.

    Args:
        metadata: LMCache's ``LMCacheMetadata`` (None in tests without an engine).
        vllm_config: vLLM's config; by default vLLM's current one, if any.
    """
    writer = current_writer()
    identity: dict[str, Any] = {"writer": writer.name, "writer_version": writer.version}
    if metadata is not None:
        identity.update(kv_shape=[int(x) for x in metadata.kv_shape],
                        kv_dtype=str(metadata.kv_dtype), use_mla=bool(metadata.use_mla))
    config = vllm_config if vllm_config is not None else _current_vllm_config()
    if config is not None:
        identity.update(_vllm_identity(config, writer, metadata))
    return identity


def describe_difference(stored: dict[str, Any], engine: dict[str, Any]) -> str:
    """One line naming the fields that differ, e.g. ``block_size 128 (engine 32)``."""
    names = sorted(set(stored) | set(engine))
    diffs = [f"{n} {stored.get(n)!r} (engine {engine.get(n)!r})" for n in names
             if stored.get(n) != engine.get(n)]
    return ", ".join(diffs)


def _current_vllm_config() -> Any:
    try:
        current_config = upstream.CURRENT_CONFIG.resolve()
    except ImportError:  # LMCache without vLLM (tests, other engines)
        return None
    return current_config()


def _vllm_identity(config: Any, writer: Writer, metadata: Any) -> dict[str, Any]:
    cache = getattr(config, "cache_config", None)
    model = getattr(config, "model_config", None)
    out: dict[str, Any] = {}
    if cache is not None:
        out["block_size"] = getattr(cache, "block_size", None)
        out["cache_dtype"] = str(getattr(cache, "cache_dtype", ""))
    if model is not None:
        out["model_config"] = _fingerprint(getattr(model, "hf_config", None))
        out["model_dtype"] = str(getattr(model, "dtype", ""))
    try:
        import vllm

        out["vllm"] = str(vllm.__version__)
    except ImportError:
        pass
    if writer == CPU_BLOCKS:
        out["packing"] = _cpu_packing(model, cache, metadata)
    return out


def _fingerprint(hf_config: Any) -> Optional[str]:
    """Short hash of the model's config (architecture, sizes, rope...), None when unknown."""
    if hf_config is None:
        return None
    try:
        text = hf_config.to_json_string(use_diff=False)
    except (AttributeError, TypeError, ValueError):
        text = json.dumps(repr(hf_config))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cpu_packing(model: Any, cache: Any, metadata: Any) -> str:
    """The CPU attention kernel's KV packing (vLLM picks it from dtype, block size, head size)."""
    try:
        attention_isa = upstream.CPU_ATTENTION_ISA.resolve()
        head_size = int(metadata.kv_shape[4]) if metadata is not None else None
        return str(attention_isa(model.dtype, cache.block_size, head_size, cache.cache_dtype))
    except Exception:  # a vLLM internal: an unknown packing is recorded as such
        return "unknown"
