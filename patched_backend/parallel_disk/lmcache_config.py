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
