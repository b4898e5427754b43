# SPDX-License-Identifier: Apache-2.0
"""The fallback when BPF cannot run: periodic /sys/block/*/inflight samples and diskstats deltas.

It cannot see single requests, so it writes queue_depth rows (source `sysfs`) and per-device
counters for the manifest, never block_io rows.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterable

import pandas as pd

# /proc/diskstats fields after the name: reads, merged, sectors, ms, writes, merged, sectors, ms,
# in flight, io ms, weighted ms (Documentation/admin-guide/iostats.rst).
DISKSTAT_FIELDS = ("reads", "reads_merged", "read_sectors", "read_ms", "writes", "writes_merged",
                   "write_sectors", "write_ms", "in_flight", "io_ms", "weighted_ms")


def default_devices(sys_root: Path = Path("/sys")) -> list[str]:
    """Every disk but unbound loop devices and ram disks."""
    names = []
    for node in sorted((sys_root / "block").iterdir()):
        if node.name.startswith("ram"):
            continue
        if node.name.startswith("loop") and not (node / "loop" / "backing_file").exists():
            continue
        names.append(node.name)
    return names


def read_diskstats(text: str, devices: Iterable[str]) -> dict[str, dict[str, int]]:
    """Counters of the given devices from the text of /proc/diskstats."""
    wanted = set(devices)
    stats = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 14 and parts[2] in wanted:
            stats[parts[2]] = dict(zip(DISKSTAT_FIELDS, (int(v) for v in parts[3:14])))
    return stats


def diskstats_delta(before: dict[str, dict[str, int]],
                    after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per-device counter growth; gauges (in_flight) keep their final value."""
    out = {}
    for dev, end in after.items():
        start = before.get(dev, {k: 0 for k in end})
        out[dev] = {k: (end[k] if k == "in_flight" else end[k] - start[k]) for k in end}
        out[dev]["read_bytes"] = out[dev]["read_sectors"] * 512
        out[dev]["write_bytes"] = out[dev]["write_sectors"] * 512
    return out


class InflightSampler:
    """Samples /sys/block/<dev>/inflight every interval_s on a thread until stop()."""

    def __init__(self, devices: Iterable[str], interval_s: float = 0.05,
                 sys_root: Path = Path("/sys")) -> None:
        self.devices = list(devices)
        missing = [d for d in self.devices if not (sys_root / "block" / d / "inflight").exists()]
        if missing:
            raise ValueError(f"devices {missing}: no {sys_root}/block/<dev>/inflight; pass disk "
                             f"names from {sys_root}/block")
        self._files = {d: sys_root / "block" / d / "inflight" for d in self.devices}
        self._interval = interval_s
        self._rows: list[tuple[int, str, int]] = []
        self._stop = threading.Event()
        self._before = self._diskstats()
        self._thread = threading.Thread(target=self._loop, name="kvscope-sampler", daemon=True)
        self._thread.start()

    def _diskstats(self) -> dict[str, dict[str, int]]:
        return read_diskstats(Path("/proc/diskstats").read_text(), self.devices)

    def _loop(self) -> None:
        while True:
            now = time.monotonic_ns()
            for dev, path in self._files.items():
                reads, writes = (int(v) for v in path.read_text().split())
                self._rows.append((now, dev, reads + writes))
            if self._stop.wait(self._interval):
                return

    def stop(self, phase: str) -> tuple[pd.DataFrame, dict[str, dict[str, int]]]:
        """queue_depth rows (source sysfs) and the diskstats deltas over the sampling time."""
        self._stop.set()
        self._thread.join()
        frame = pd.DataFrame(self._rows, columns=["ts_ns", "device", "inflight"])
        frame.insert(0, "phase", phase)
        frame["hw_queue"] = -1
        frame["source"] = "sysfs"
        return frame.astype({"ts_ns": "int64", "inflight": "int64", "hw_queue": "int64"}), \
            diskstats_delta(self._before, self._diskstats())
