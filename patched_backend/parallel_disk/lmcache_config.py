# SPDX-License-Identifier: Apache-2.0
"""LMCache settings that enable this backend: used by ``kvscope run`` profiles and docs."""

# Standard
from pathlib import Path
from typing import Any

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


def pipelines_transfer(config: Any) -> bool:
    """Whether an LMCache config loads this backend with ``pipeline_transfer`` on (and no CPU
    tier that would keep chunks handed out before their reads end)."""
    from kvscope.patched_backend.parallel_disk.config import from_extra_config

    extra = getattr(config, "extra_config", None) or {}
    ours = [name for name in getattr(config, "storage_plugins", None) or []
            if extra.get(f"storage_plugin.{name}.module_path") == MODULE]
    if not ours or getattr(config, "local_cpu", False):
        return False
    try:
        settings = from_extra_config(extra, float(getattr(config, "max_local_disk_size", 0) or 0))
    except ValueError:
        return False  # the backend itself refuses such a config, with the message
    return settings.pipeline_transfer and not settings.write_only
