"""Phase observers `kvscope run` attaches around each phase."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvscope.workload.server import VLLMServer


class ProbeObserver:
    """Runs the block/NVMe probes (or their sysfs fallback) for each phase, on the server's I/O."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._session = None

    def start_phase(self, run: Path, phase: str, server: "VLLMServer") -> None:
        from probes import session

        devices = [self.device] if self.device else None
        self._session = session.start(run, phase, pids=server.pids(), devices=devices)

    def stop_phase(self) -> None:
        if self._session is not None:
            self._session.stop()
            self._session = None
