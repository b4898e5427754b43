# SPDX-License-Identifier: Apache-2.0
"""The backend's counters as files, so a run keeps them whether or not it traces.

With ``KVSCOPE_BACKEND_STATS_DIR`` set (``kvscope run`` sets ``RUN/backend``), each process that
holds a kvscope disk backend rewrites ``<dir>/<pid>.json`` with its backends' counters every
``INTERVAL_S`` while one is open and once more as each closes; the driver sums them into
``manifest.disk_backend`` at the end of each phase (``totals``, ``wait_for_update``).
"""

# Standard
from pathlib import Path
from typing import Any, Optional
import json
import logging
import os
import threading
import time

# First Party
from kvscope.contract import files
from kvscope.contract.counters import CORRUPT_BY_REASON, DISK_BACKEND_COUNTERS
from kvscope.contract.env import ENV_BACKEND_STATS_DIR
from kvscope.patched_backend.parallel_disk import hooks

INTERVAL_S = 0.5
logger = logging.getLogger(__name__)
_lock = threading.Lock()


class _Writer:
    """This process's file, rewritten every INTERVAL_S while one of its backends is open."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.open = 0
        self.stopped = threading.Event()
        threading.Thread(target=self._loop, daemon=True, name="kvscope-backend-stats").start()

    def _loop(self) -> None:
        while not self.stopped.wait(INTERVAL_S):
            write(self.target)


_writers: dict[int, _Writer] = {}  # pid -> its writer (a forked child makes its own)


def directory() -> Optional[Path]:
    value = os.environ.get(ENV_BACKEND_STATS_DIR, "").strip()
    return Path(value) if value else None


def opened() -> None:
    """A backend of this process opened: write its counters from now on, if the run says where."""
    target = directory()
    if target is None:
        return
    with _lock:
        writer = _writers.get(os.getpid())
        if writer is None or writer.stopped.is_set():
            target.mkdir(parents=True, exist_ok=True)
            writer = _writers[os.getpid()] = _Writer(target)
        writer.open += 1
    write(target)


def closed() -> None:
    """A backend of this process closed: its final counters now; the last one stops the writer."""
    with _lock:
        writer = _writers.get(os.getpid())
        if writer is None:
            return
        writer.open -= 1
        if writer.open <= 0:
            writer.stopped.set()
    write(writer.target)


def write(target: Path) -> None:
    """Rewrite this process's file now (atomically); never raises into the backend."""
    try:
        body = {"pid": os.getpid(), "written_ns": time.monotonic_ns(),
                "backends": [backend.stats() for backend in hooks.live_backends()]}
        files.atomic_write(target / f"{os.getpid()}.json", json.dumps(body, default=str))
    except Exception:  # counters are telemetry: the backend serves on
        logger.warning("kvscope disk: backend counters not written to %s", target, exc_info=True)


def _read(target: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(target.glob("*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being replaced: the next read has it
    return out


def totals(target: Path) -> dict[str, Any]:
    """Every backend's counters summed over every process's file ({} when none wrote)."""
    total: dict[str, Any] = {}
    for process in _read(target):
        for backend in process.get("backends", ()):
            for name in DISK_BACKEND_COUNTERS:
                total[name] = total.get(name, 0) + int(backend.get(name, 0))
            reasons = total.setdefault(CORRUPT_BY_REASON, {})
            for reason, count in backend.get(CORRUPT_BY_REASON, {}).items():
                reasons[reason] = reasons.get(reason, 0) + int(count)
    return total


def wait_for_update(target: Path, since_ns: int, timeout_s: float = 4 * INTERVAL_S) -> bool:
    """Wait until every process's file was written after `since_ns` (monotonic); False when
    one was not within `timeout_s` (its process stopped: its last counters stand)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(p.get("written_ns", 0) >= since_ns for p in _read(target)):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(INTERVAL_S / 5)
