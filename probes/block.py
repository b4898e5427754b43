# SPDX-License-Identifier: Apache-2.0
"""The block probe: one record per block request, in-kernel log2 histograms, in-flight depth.

Usage (as root):
    with BlockProbe(BlockOptions(), pids={1234}, devices={"vda"}) as probe:
        ...workload...
    result = probe.result("cold")   # block_io and queue_depth frames, histograms, lost counts
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from kvscope.contract.host import whole_disk
from kvscope.probes import frames
from kvscope.probes.btf import kernel_offsets
from kvscope.probes.block_bpf import BATCH_DTYPE, LOST_KEYS, TWIN, BlockOptions, render
from kvscope.probes.collect import RingCollector


@dataclass
class BlockResult:
    """What one probe session saw, ready for the run directory."""

    block_io: pd.DataFrame
    queue_depth: pd.DataFrame
    histograms: dict[str, dict[str, dict[int, int]]]  # kind -> device -> log2(us) slot -> count
    lost_events: dict[str, int]


def resolve_device(name: str, sys_root: Path = Path("/sys")) -> int:
    """Kernel dev_t of a whole disk named like `vda`, `/dev/loop3` or a partition of one."""
    node = sys_root / "class" / "block" / Path(name).name
    if not (node / "dev").exists():
        raise ValueError(f"device {name!r}: no such block device in {sys_root}/class/block; "
                         f"pass a disk name such as vda, nvme0n1 or loop0")
    if (node / "partition").exists():
        node = node.resolve().parent
    major, minor = (int(x) for x in (node / "dev").read_text().split(":"))
    return (major << 20) | minor


def disk_holding(path: Path) -> str:
    """Name of the whole disk under the file system holding `path` (e.g. the KV cache folder);
    ValueError when there is none to probe."""
    disk = whole_disk(path)
    if not disk:
        raise ValueError(f"{path} is not on a block device (its file system is e.g. tmpfs or "
                         f"overlay, or it does not exist); put the data on a disk to probe its "
                         f"reads")
    return disk


class BlockProbe:
    """Attach on start(), detach on stop(); both idempotent. Needs root and bcc."""

    def __init__(self, opts: BlockOptions, *, pids: Iterable[int] | None = None,
                 devices: Iterable[str] | None = None) -> None:
        self.pids = sorted(set(pids or ()))
        self.devs = sorted({resolve_device(d) for d in devices or ()})
        offsets = opts.offsets or (kernel_offsets() if opts.key == "rq" else {})
        self.opts = replace(opts, filter_pids=bool(self.pids), filter_devices=bool(self.devs),
                            offsets=offsets)
        self._bpf: Any = None
        self._collector: RingCollector | None = None
        self._records: Any = None
        self._open: list[tuple[int, int]] = []
        self._hists: dict[str, dict[str, dict[int, int]]] = {}
        self._lost: dict[str, int] = {}
        self._twin_fd = -1

    def start(self) -> "BlockProbe":
        if self._bpf is not None:
            return self
        from bcc import BPF

        bpf = BPF(text=render(self.opts).encode())
        try:
            if self.opts.key == "rq":
                self._twin_fd = _attach_twin(bpf)
            for pid in self.pids:
                bpf[b"pids"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
            for dev in self.devs:
                bpf[b"devs"][ctypes.c_uint32(dev)] = ctypes.c_uint8(1)
            self._collector = RingCollector(bpf, {"events": BATCH_DTYPE})
        except BaseException:
            bpf.cleanup()
            raise
        self._bpf = bpf
        return self

    def stop(self) -> None:
        """Detach every program, then drain what they recorded (kept for result())."""
        if self._bpf is None:
            return
        bpf, self._bpf = self._bpf, None
        try:
            self._detach(bpf)
            self._drain(bpf)
        finally:
            bpf.cleanup()

    def _detach(self, bpf: Any) -> None:
        """Stop the programs from firing, keeping them and their maps, so no record can land
        after the final drain (a batch flushed then would be lost)."""
        if self._twin_fd >= 0:
            os.close(self._twin_fd)
            self._twin_fd = -1
        for tp in list(bpf.raw_tracepoint_fds):
            bpf.detach_raw_tracepoint(tp)
        for tp in list(bpf.tracepoint_fds):
            bpf.detach_tracepoint(tp)

    def _drain(self, bpf: Any) -> None:
        batches = [self._collector.stop()["events"], _pending_batches(bpf[b"pending"])]
        self._records = np.concatenate([_unbatch(b) for b in batches])
        still_open = [r for r in bpf[b"reqs"].values() if r.issue_ns]
        self._open = [(int(r.dev), int(r.issue_ns)) for r in still_open]
        self._hists = {kind: _histogram(bpf[kind.encode()]) for kind in ("queue_us", "service_us")}
        lost = bpf[b"lost"]
        self._lost = {k: int(lost[ctypes.c_int(i)].value) for i, k in enumerate(LOST_KEYS)}
        self._lost["bad_record_size"] = self._collector.bad_sizes["events"]
        self._lost["unfinished_at_stop"] = sum(1 for r in still_open if r.tracked)
        self._lost.update(recursion_misses(bpf, twins=self.opts.key == "rq"))

    def program_ids(self) -> list[int]:
        """Kernel ids of the loaded programs (`bpftool prog show id N`), to check detaching."""
        return program_ids(self._bpf)

    def __enter__(self) -> "BlockProbe":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def result(self, phase: str) -> BlockResult:
        """Tables and counters of the stopped probe."""
        if self._records is None:
            raise RuntimeError("BlockProbe.result() needs a started and stopped probe")
        from_status = self.opts.key == "rq"
        steps = frames.block_steps(self._records, self._open)
        named = {kind: {frames.device_name(dev): slots for dev, slots in per_dev.items()}
                 for kind, per_dev in self._hists.items()}
        return BlockResult(
            block_io=frames.block_frame(self._records, phase, from_status=from_status),
            queue_depth=frames.depth_series(steps, phase),
            histograms=named,
            lost_events=dict(self._lost),
        )


def _attach_twin(bpf: Any) -> int:
    """Attach the second completion program; bcc keeps one attachment per raw tracepoint
    name, so this one goes through libbcc directly and its fd is closed by stop()."""
    from bcc import BPF
    from bcc.libbcc import lib

    fn = bpf.load_func(TWIN, BPF.RAW_TRACEPOINT)
    fd = lib.bpf_attach_raw_tracepoint(fn.fd, b"block_rq_complete")
    if fd < 0:
        raise OSError(f"cannot attach {TWIN.decode()} to raw tracepoint block_rq_complete")
    return fd


def program_ids(bpf: Any) -> list[int]:
    """Ids of the programs a bcc BPF object loaded (`bpftool prog show id N`)."""
    return sorted(_ids_by_name(bpf).values()) if bpf is not None else []


def _ids_by_name(bpf: Any) -> dict[bytes, int]:
    """Program name -> kernel id, read from /proc/self/fdinfo of the program fds."""
    ids = {}
    for name, fn in bpf.funcs.items():
        for line in Path(f"/proc/self/fdinfo/{fn.fd}").read_text().splitlines():
            if line.startswith("prog_id:"):
                ids[name] = int(line.split()[1])
    return ids


def recursion_misses(bpf: Any, *, twins: bool) -> dict[str, int]:
    """Runs the kernel skipped because a program was already running on that CPU, from
    `bpftool prog show` (-1 when bpftool is missing). With `twins` (rq mode) skips of the
    completion programs are `complete_nested`: the other twin took those unless both were
    busy. Without (dev_sector mode) a skipped completion is lost, so it counts as a miss."""
    ids = _ids_by_name(bpf)
    covered = {i for name, i in ids.items() if b"block_rq_complete" in name} if twins else set()
    misses = bpftool_misses()
    if misses is None:
        return {"recursion_misses": -1}
    counts = {"recursion_misses": sum(misses.get(i, 0) for i in ids.values() if i not in covered)}
    if twins:
        counts["complete_nested"] = sum(misses.get(i, 0) for i in covered)
    return counts


def bpftool_misses() -> dict[int, int] | None:
    """recursion_misses of every loaded program by id (`bpftool prog show`); None without
    bpftool."""
    try:
        out = subprocess.run(["bpftool", "prog", "show", "-j"], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {p["id"]: p.get("recursion_misses", 0) for p in json.loads(out)}


def _pending_batches(table: Any) -> np.ndarray:
    """The per-CPU batches of both completion programs not yet full when the probe stopped."""
    raw = b"".join(ctypes.string_at(ctypes.addressof(b), ctypes.sizeof(b))
                   for slot in (0, 1) for b in table[ctypes.c_int(slot)])
    return np.frombuffer(raw, dtype=BATCH_DTYPE)


def _unbatch(batches: np.ndarray) -> np.ndarray:
    """Flat completion records from batches, each holding its first `n` events."""
    keep = np.arange(batches["ev"].shape[1]) < batches["n"][:, None]
    return batches["ev"][keep]


def _histogram(table: Any) -> dict[int, dict[int, int]]:
    """A BPF_HISTOGRAM keyed by {dev, slot} as dev -> slot -> count."""
    out: dict[int, dict[int, int]] = {}
    for key, count in table.items():
        out.setdefault(int(key.dev), {})[int(key.slot)] = int(count.value)
    return out
