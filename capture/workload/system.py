"""Host facts and host actions the driver needs: page cache, disk counters, ports.

The manifest's host blocks and the disk under a path are contract.host's (every producer's).
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path


class HostError(RuntimeError):
    """Something about this host stops the run; the message says what to do."""


def require_root_for_drop_caches() -> None:
    if os.geteuid() != 0:
        raise HostError(
            "cold phases drop the page cache (/proc/sys/vm/drop_caches), which needs root; "
            "run as root, or pass --phases warm to skip the cold phase"
        )


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def check_writable_dir(path: Path) -> None:
    """Create path if needed and prove a file can be written there."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvscope-probe-") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise HostError(
            f"KV directory {path} is not writable ({e.strerror}); pass --kv-dir with a "
            "writable directory on the disk you want to measure"
        ) from None


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As uvicorn does: a previous server's TIME_WAIT connections must not count as in use.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise HostError(
                    f"port {port} on {host} is already in use; pass --port with a free port"
                ) from None
            raise


@dataclass(frozen=True)
class DiskCounters:
    read_bytes: int
    write_bytes: int


def disk_counters(device: str) -> DiskCounters:
    """Bytes read and written so far by device, from /proc/diskstats (512-byte sectors)."""
    for line in Path("/proc/diskstats").read_text().splitlines():
        fields = line.split()
        if fields[2] == device:
            return DiskCounters(int(fields[5]) * 512, int(fields[9]) * 512)
    return DiskCounters(0, 0)
