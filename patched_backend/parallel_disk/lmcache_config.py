# SPDX-License-Identifier: Apache-2.0
"""LMCache settings that enable this backend: used by ``kvscope run`` profiles and docs."""

import logging
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)
MODULE = "kvscope.patched_backend.parallel_disk.backend"
CLASS = "ParallelDiskBackend"


def lmcache_settings(kv_dir: Path, mode: str = "parallel", capacity: str = "64GB",
                     **knobs: Any) -> dict[str, Any]:
    """LMCache config keys loading the plugin as ``kvscope`` on ``kv_dir``.

    Args:
        kv_dir: directory for the chunk files.
        mode: ``parallel`` or ``serial``.
        capacity: byte budget of the tier.
        **knobs: other ``kvscope.<name>`` knobs, e.g. ``read_delay_ms=50``.
    """
    extra = {
        "storage_plugin.kvscope.module_path": MODULE,
        "storage_plugin.kvscope.class_name": CLASS,
        "kvscope.path": str(kv_dir), "kvscope.mode": mode, "kvscope.capacity": capacity,
        **{f"kvscope.{name}": value for name, value in knobs.items()},
    }
    return {"storage_plugins": ["kvscope"], "extra_config": extra}


def copies_outside_connector(config: Any, metadata: Any) -> Optional[str]:
    """Why an LMCache engine of this config and model would copy a got chunk's bytes other than
    through its connector's ``batched_to_gpu`` (then a chunk handed out unverified could reach
    the KV cache unchecked), or None when the connector makes every copy.

    LMCache 0.5.6's retrieve, read for every path that copies: MLA models save and load on the
    first rank only (``save_only_first_rank``, on by default for MLA even at TP=1, and read as
    LMCache reads it: any truthy value, "false" included), and its
    retrieve broadcasts the got chunks and hands the connector copies of them; layerwise
    retrieval (``use_layerwise``, also under CacheBlend) gets through the non-blocking get,
    which verifies, and copies layer by layer, so there is no per-chunk copy to pipeline.
    ``save_unfull_chunk``, P2P, PD and the controller's move and compression either copy through
    the connector or get outside a retrieve, where every get verifies (handoff.py).
    """
    extra = getattr(config, "extra_config", None) or {}
    if getattr(metadata, "use_mla", False) and extra.get("save_only_first_rank", True):
        return "LMCache broadcasts an MLA model's chunks itself (save_only_first_rank)"
    if getattr(config, "use_layerwise", False):
        return "layerwise retrieval copies layer by layer"
    return None


def pipelines_transfer(config: Any, metadata: Any) -> bool:
    """Whether an LMCache config loads this backend with ``pipeline_transfer`` on, with no CPU
    tier that would keep chunks handed out before their reads end, for an engine whose
    connector makes every copy of a got chunk (``copies_outside_connector``)."""
    from kvscope.patched_backend.parallel_disk.config import from_extra_config

    extra = getattr(config, "extra_config", None) or {}
    ours = [name for name in getattr(config, "storage_plugins", None) or []
            if extra.get(f"storage_plugin.{name}.module_path") == MODULE]
    if not ours or getattr(config, "local_cpu", False):
        return False
    reason = copies_outside_connector(config, metadata)
    if reason is not None:
        logger.info("kvscope: pipeline_transfer is off: %s; every get verifies its chunks "
                    "before LMCache sees them", reason)
        return False
    try:
        settings = from_extra_config(extra, float(getattr(config, "max_local_disk_size", 0) or 0))
    except ValueError:
        return False  # the backend itself refuses such a config, with the message
    return settings.pipeline_transfer and not settings.write_only
