"""Phase observers `kvscope run` attaches around each phase."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvscope.contract import rundir
from kvscope.contract.counters import READ_KNOBS_KEY
from kvscope.contract.env import ENV_BACKEND_STATS_DIR
from kvscope.patched_backend.parallel_disk import statsfile

if TYPE_CHECKING:
    from kvscope.capture.workload.server import VLLMServer
    from kvscope.probes.session import ProbeSession


class ProbeObserver:
    """Runs the block/NVMe probes (or their sysfs fallback) for each phase, on the server's I/O."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._session: ProbeSession | None = None

    def start_phase(self, run: Path, phase: str, server: "VLLMServer") -> None:
        from kvscope.probes import session

        devices = [self.device] if self.device else None
        self._session = session.start(run, phase, pids=server.pids(), devices=devices)

    def stop_phase(self) -> None:
        if self._session is not None:
            self._session.stop()
            self._session = None


class DiskBackendObserver:
    """manifest.disk_backend: the kvscope disk backend's counters (cumulative since the server
    started) as they stood at each phase's end, from the files it writes into RUN/backend/,
    whether or not the run traces. No section when no kvscope backend ran."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.directory = run / rundir.BACKEND_STATS_DIR
        self._phase = ""
        self._by_phase: dict[str, dict] = {}

    def server_env(self) -> dict[str, str]:
        """Where the server's backend writes its counters."""
        return {ENV_BACKEND_STATS_DIR: str(self.directory)}

    def start_phase(self, run: Path, phase: str, server: "VLLMServer") -> None:
        self._phase = phase

    def stop_phase(self) -> None:
        statsfile.wait_for_update(self.directory, time.monotonic_ns())
        counters = statsfile.totals(self.directory)
        if counters:
            self._by_phase[self._phase] = counters
            rundir.update_manifest(self.run, "disk_backend", {
                "counters": counters, "by_phase": dict(self._by_phase),
                READ_KNOBS_KEY: statsfile.read_knobs(self.directory)})
