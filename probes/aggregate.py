# SPDX-License-Identifier: Apache-2.0
"""The aggregate (always-on) block probe: per-device and per-process latency histograms and
counters kept in the kernel, per-I/O rows only for the tracked thread / process ids.

Usage (as root):
    with AggregateProbe(track={engine_pid, *reader_tids}, devices={"vda"}) as probe:
        ...workload...
    result = probe.result("cold")   # io_histograms, io_totals, block_io (tracked only), lost
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from kvscope.probes import aggregate_frames, frames, tp_btf
from kvscope.probes.aggregate_bpf import (LOST_KEYS, MAX_DEVS, NSTATS, PID_BITMAP_WORDS, PROGRAMS,
                                          TRACKING_PROGRAMS, AggregateOptions, render)
from kvscope.probes.block import resolve_device
from kvscope.probes.block_bpf import EVENT_DTYPE
from kvscope.probes.btf import AGGREGATE_NEEDED, kernel_offsets, kernel_tracepoint_ids
from kvscope.probes.lifecycle import Probe, recursion_misses

# Tracked rows are few (the server's own reads), so the ring buffer is drained 4 times a second
# (a wake-up costs ~0.05 % of a core here); 4 MiB holds ~43k rows, 170k rows/s between drains.
ROW_POLL_MS = 250


@dataclass
class AggregateResult:
    """What one aggregate probe session saw, ready for the run directory."""

    block_io: pd.DataFrame  # tracked ids' requests only
    histograms: pd.DataFrame  # io_histograms rows
    totals: pd.DataFrame  # io_totals rows
    lost_events: dict[str, int]


class AggregateProbe(Probe[AggregateResult]):
    """Attach on start(), detach on stop(); both idempotent. Needs root, bcc and BTF."""

    ring_poll_ms = ROW_POLL_MS

    def __init__(self, *, track: Iterable[int] | None = None,
                 devices: Iterable[str] | None = None,
                 offsets: dict[str, int] | None = None) -> None:
        super().__init__()
        self.track = sorted(set(track or ()))
        bad = [i for i in self.track if not 0 < i < PID_BITMAP_WORDS * 64]
        if bad:
            raise ValueError(f"ids {bad}: thread / process ids must be in "
                             f"1..{PID_BITMAP_WORDS * 64 - 1}")
        self.filter_devices = bool(devices)
        names = sorted(set(devices or ()) or _every_disk())
        if len(names) >= MAX_DEVS:
            raise ValueError(f"{len(names)} disks: the aggregate probe keeps at most "
                             f"{MAX_DEVS - 1}; pass the disks to probe with devices=")
        # stats index (1..) -> dev_t and name
        self.devs = {i: (resolve_device(n), _whole_disk_name(n)) for i, n in enumerate(names, 1)}
        self.opts = AggregateOptions(track=bool(self.track), filter_devices=self.filter_devices,
                                     track_threads=any(not _is_process(i) for i in self.track),
                                     offsets=offsets or kernel_offsets(AGGREGATE_NEEDED))
        self._records = np.zeros(0, dtype=EVENT_DTYPE)
        self._counters: aggregate_frames.Counters = {}
        self._lost: dict[str, int] = {}
        self._programs = TRACKING_PROGRAMS if self.track else PROGRAMS

    @property
    def tracepoints(self) -> list[str]:
        return [f"tp_btf:block:{n}" for n in self._programs]

    def program_text(self) -> str:
        return render(self.opts)

    def _prepare(self, bpf: Any) -> None:
        for idx, (dev, _) in self.devs.items():
            bpf[b"dev_idx"][ctypes.c_uint32(dev)] = ctypes.c_uint32(idx)
        words: dict[int, int] = {}
        for i in self.track:
            words[i >> 6] = words.get(i >> 6, 0) | 1 << (i & 63)
        for word, value in words.items():
            bpf[b"track_ids"][ctypes.c_int(word)] = ctypes.c_uint64(value)

    def _rings(self) -> dict[str, np.dtype]:
        return {"events": EVENT_DTYPE} if self.track else {}

    def _attach(self, bpf: Any) -> list[tp_btf.Attached]:
        type_ids = kernel_tracepoint_ids(tuple(self._programs))
        attached: list[tp_btf.Attached] = []
        try:
            for tracepoint, func in self._programs.items():
                attached.append(tp_btf.attach(bpf, func, type_ids[tracepoint], tracepoint))
        except BaseException:
            for program in attached:
                program.close()
            raise
        return attached

    def _drain(self, bpf: Any, records: dict[str, np.ndarray], bad_sizes: dict[str, int]) -> None:
        self._records = records.get("events", self._records)
        names = {idx: name for idx, (_, name) in self.devs.items()}
        counted = [((names[idx], -1), v) for idx, v in _per_cpu_stats(bpf, names)]
        if self.track:
            for key, value in bpf[b"proc_stats"].items():
                v = np.frombuffer(ctypes.string_at(ctypes.addressof(value), ctypes.sizeof(value)),
                                  dtype="<u8")
                if int(key.idx) in names:
                    counted.append(((names[int(key.idx)], int(key.tgid)), v))
        self._counters = aggregate_frames.sum_by_key(counted)
        lost = bpf[b"lost"]
        self._lost = {k: int(lost[ctypes.c_int(i)].value) for i, k in enumerate(LOST_KEYS)}
        self._lost["bad_record_size"] = bad_sizes.get("events", 0)
        self._lost.update(recursion_misses(self._ids_by_name()))

    def _result(self, phase: str) -> AggregateResult:
        records = self._records.copy()
        records["dev"] = [self.devs[int(i)][0] for i in records["dev"]]  # index -> dev_t
        window = self.stopped_ns - self.started_ns
        return AggregateResult(
            block_io=frames.block_frame(records, phase, from_status=True),
            histograms=aggregate_frames.histograms_frame(self._counters, phase),
            totals=aggregate_frames.totals_frame(self._counters, phase, window),
            lost_events=dict(self._lost),
        )


def _is_process(task_id: int) -> bool:
    """Whether a thread / process id names a process (its own thread group leader); an id
    that is gone counts as a process (nothing of it can be submitted any more)."""
    try:
        status = Path(f"/proc/{task_id}/status").read_text()
    except OSError:
        return True
    return next(line.split()[1] for line in status.splitlines()
                if line.startswith("Tgid:")) == str(task_id)


def _every_disk(sys_root: Path = Path("/sys")) -> list[str]:
    """Every whole disk the kernel has now (partitions are counted under their disk)."""
    return sorted(p.name for p in (sys_root / "block").iterdir())


def _whole_disk_name(name: str) -> str:
    return frames.device_name(resolve_device(name))


def _per_cpu_stats(bpf: Any, names: dict[int, str]) -> list[tuple[int, np.ndarray]]:
    """(index, counters summed over CPUs) for the probed disks' stats indexes."""
    table = bpf[b"dev_stats"]
    out = []
    for idx in names:
        per_cpu = table.getvalue(ctypes.c_int(idx))
        raw = ctypes.string_at(ctypes.addressof(per_cpu), ctypes.sizeof(per_cpu))
        out.append((idx, np.frombuffer(raw, dtype="<u8").reshape(-1, NSTATS).sum(axis=0)))
    return out
