# SPDX-License-Identifier: Apache-2.0
"""The backend's counters as files, so a run keeps them whether or not it traces.

With ``KVSCOPE_BACKEND_STATS_DIR`` set (``kvscope run`` sets ``RUN/backend``), each process that
holds a kvscope disk backend rewrites ``<dir>/<pid>.json`` with its backends' counters every
``INTERVAL_S`` while one is open and once more as each closes; the driver sums them into
``manifest.disk_backend`` at the end of each phase (``totals``, ``wait_for_update``).
The directory must be private to the server's user (``kvscope.contract.files``): one that is
not gets no files, with one log line saying why, and the backend serves on. Readers (the
driver, and ``kvscope record`` reading a server's files as root) read each file capped, not
through a link, and sum only files of the shape written here.
"""

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from kvscope.contract import files, jsonfiles
from kvscope.contract.counters import CORRUPT_BY_REASON, DISK_BACKEND_COUNTERS, READ_KNOBS
from kvscope.contract.env import ENV_BACKEND_STATS_DIR
from kvscope.patched_backend.parallel_disk import hooks

INTERVAL_S = 0.5
MAX_FILE_BYTES = 1 << 20  # a process's counters: a few hundred bytes per backend
_COUNT = {"type": "integer", "minimum": 0}
FILE_SCHEMA = {
    "type": "object",
    "properties": {
        "pid": {"type": "integer"},
        "written_ns": {"type": "integer"},
        "backends": {"type": "array", "items": {
            "type": "object",
            "properties": {**dict.fromkeys(DISK_BACKEND_COUNTERS, _COUNT),
                           CORRUPT_BY_REASON: {"type": "object", "additionalProperties": _COUNT}},
        }},
    },
}
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
            try:
                files.private_dir(target)
            except files.UnsafePath as e:
                logger.warning("kvscope disk: backend counters are not written (%s); the "
                               "backend serves on; unset %s or name a directory of this user",
                               e, ENV_BACKEND_STATS_DIR)
                return
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


def read_files(target: Path, owners: Optional[Iterable[int]] = None
               ) -> tuple[list[dict[str, Any]], list[str]]:
    """(every process's file of FILE_SCHEMA's shape, one line per file refused), read as
    ``contract.jsonfiles`` reads: regular files of `owners` (default this user or root), at
    most MAX_FILE_BYTES."""
    return jsonfiles.read_json_files(sorted(target.glob("*.json")), MAX_FILE_BYTES, FILE_SCHEMA,
                                     owners)


def totals(target: Path) -> dict[str, Any]:
    """Every backend's counters summed over every process's file ({} when none wrote); files
    refused by ``read_files`` are left out (``read_files`` names them)."""
    return sum_files(read_files(target)[0])


def sum_files(processes: list[dict[str, Any]]) -> dict[str, Any]:
    """Every backend's counters summed over processes' files as ``read_files`` gives them."""
    total: dict[str, Any] = {}
    for process in processes:
        for backend in process.get("backends", ()):
            for name in DISK_BACKEND_COUNTERS:
                total[name] = total.get(name, 0) + int(backend.get(name, 0))
            reasons = total.setdefault(CORRUPT_BY_REASON, {})
            for reason, count in backend.get(CORRUPT_BY_REASON, {}).items():
                reasons[reason] = reasons.get(reason, 0) + int(count)
    return total


def read_knobs(target: Path) -> dict[str, Any]:
    """The read knobs of the backend that served reads ({} when none did): a write-only tier
    beside another (the study's warm copy) reads nothing and is skipped."""
    for process in read_files(target)[0]:
        for backend in process.get("backends", ()):
            if backend.get("lookup_hits") or backend.get("read_batches"):
                return {name: backend.get(name) for name in READ_KNOBS}
    return {}


def wait_for_update(target: Path, since_ns: int, timeout_s: float = 4 * INTERVAL_S) -> bool:
    """Wait until every process's file was written after `since_ns` (monotonic); False when
    one was not within `timeout_s` (its process stopped: its last counters stand)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(p.get("written_ns", 0) >= since_ns for p in read_files(target)[0]):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(INTERVAL_S / 5)
