# SPDX-License-Identifier: Apache-2.0
"""The per-I/O block probe: one record per block request, log2 histograms, in-flight depth.

Usage (as root):
    with BlockProbe(BlockOptions(), pids={1234}, devices={"vda"}) as probe:
        ...workload...
    result = probe.result("cold")   # block_io and queue_depth frames, histograms, lost counts
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from kvscope.contract.host import whole_disk
from kvscope.probes import frames, tp_btf
from kvscope.probes.block_bpf import (BATCH_DTYPE, COMPLETE_MISSED, COMPLETE_PROGRAMS,
                                      EVENT_DTYPE, LOST_KEYS, OPS, PID_BITMAP_WORDS, RQ_PROGRAMS,
                                      SLOT_DTYPE, BlockOptions, render)
from kvscope.probes.btf import kernel_flush_seq_bit, kernel_offsets, kernel_tracepoint_ids
from kvscope.probes.lifecycle import Probe, recursion_misses


@dataclass
class BlockResult:
    """What one probe session saw, ready for the run directory."""

    block_io: pd.DataFrame
    queue_depth: pd.DataFrame
    histograms: dict[str, dict[str, dict[int, int]]]  # kind -> device -> log2(us) slot -> count
    lost_events: dict[str, int]
    # complete_missed and unfinished_at_stop per operation (R, W, F, D, O): with the rows, what
    # the kernel's per-operation counters of /sys/block/<disk>/stat are made of
    lost_by_op: dict[str, dict[str, int]]


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


class BlockProbe(Probe[BlockResult]):
    """Attach on start(), detach on stop(); both idempotent. Needs root and bcc."""

    def __init__(self, opts: BlockOptions, *, pids: Iterable[int] | None = None,
                 devices: Iterable[str] | None = None) -> None:
        super().__init__()
        self.pids = sorted(set(pids or ()))
        bad = [p for p in self.pids if not 0 < p < PID_BITMAP_WORDS * 64]
        if bad:
            raise ValueError(f"pids {bad}: process ids must be in 1..{PID_BITMAP_WORDS * 64 - 1}")
        self.devs = sorted({resolve_device(d) for d in devices or ()})
        if opts.key == "rq" and not opts.offsets:
            opts = replace(opts, offsets=kernel_offsets(), flush_seq_bit=kernel_flush_seq_bit())
        self.opts = replace(opts, filter_pids=bool(self.pids), filter_devices=bool(self.devs))
        self._records = np.zeros(0, dtype=EVENT_DTYPE)
        self._open: list[tuple[int, int]] = []
        self._lost: dict[str, int] = {}
        self._lost_by_op: dict[str, dict[str, int]] = {}

    def program_text(self) -> str:
        return render(self.opts)

    def _prepare(self, bpf: Any) -> None:
        if self.opts.key == "rq":
            words: dict[int, int] = {}
            for pid in self.pids:
                words[pid >> 6] = words.get(pid >> 6, 0) | 1 << (pid & 63)
            for word, bits in words.items():
                bpf[b"pid_bits"][ctypes.c_int(word)] = ctypes.c_uint64(bits)
        else:
            for pid in self.pids:
                bpf[b"pids"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
        for dev in self.devs:
            bpf[b"devs"][ctypes.c_uint32(dev)] = ctypes.c_uint8(1)

    def _attach(self, bpf: Any) -> list[tp_btf.Attached]:
        if self.opts.key != "rq":
            return []  # classic tracepoint programs, attached by bcc as it loads them
        attached: list[tp_btf.Attached] = []
        try:
            if self.opts.attach == "tp_btf":
                ids = kernel_tracepoint_ids(tuple(dict.fromkeys(tp for tp, _ in RQ_PROGRAMS)))
                for tracepoint, func in RQ_PROGRAMS:
                    attached.append(tp_btf.attach(bpf, func, ids[tracepoint], tracepoint))
            else:
                for tracepoint, func in RQ_PROGRAMS:
                    attached.append(tp_btf.attach_raw(bpf, func, tracepoint))
        except BaseException:
            for program in attached:
                program.close()
            raise
        return attached

    def _rings(self) -> dict[str, np.dtype]:
        return {"events": BATCH_DTYPE}

    def _drain(self, bpf: Any, records: dict[str, np.ndarray], bad_sizes: dict[str, int]) -> None:
        batches = [records["events"], _pending_batches(bpf[b"pending"])]
        self._records = np.concatenate([_unbatch(b) for b in batches])
        if self.opts.key == "rq":
            _name_threads(self._records, bpf[b"comms"])
        open_requests = _open_slots(bpf) if self.opts.key == "rq" else _open_requests(bpf)
        self._open = [(int(d), int(t)) for d, t in zip(open_requests["dev"],
                                                        open_requests["issue_ns"])]
        lost = bpf[b"lost"]
        self._lost = {k: int(lost[ctypes.c_int(i)].value) for i, k in enumerate(LOST_KEYS)}
        missed = {op: int(lost[ctypes.c_int(COMPLETE_MISSED + i)].value)
                  for i, op in enumerate(OPS)}
        tracked = open_requests[open_requests["tracked"] == 1]
        per_op = np.bincount(np.minimum(tracked["op"], len(OPS) - 1), minlength=len(OPS))
        unfinished = {op: int(n) for op, n in zip(OPS, per_op)}
        self._lost_by_op = {"complete_missed": missed, "unfinished_at_stop": unfinished}
        self._lost["complete_missed"] = sum(missed.values())
        self._lost["bad_record_size"] = bad_sizes["events"]
        self._lost["unfinished_at_stop"] = len(tracked)
        twins = COMPLETE_PROGRAMS if self.opts.key == "rq" else ()
        self._lost.update(recursion_misses(self._ids_by_name(), twins))

    def _result(self, phase: str) -> BlockResult:
        steps = frames.block_steps(self._records, self._open)
        histograms = frames.log2_histograms(self._records)
        named = {kind: {frames.device_name(dev): slots for dev, slots in per_dev.items()}
                 for kind, per_dev in histograms.items()}
        return BlockResult(
            block_io=frames.block_frame(self._records, phase, from_status=self.opts.key == "rq"),
            queue_depth=frames.depth_series(steps, phase),
            histograms=named,
            lost_events=dict(self._lost),
            lost_by_op={k: dict(v) for k, v in self._lost_by_op.items()},
        )


def _pending_batches(table: Any) -> np.ndarray:
    """The per-CPU batches of both completion programs not yet full when the probe stopped."""
    raw = b"".join(ctypes.string_at(ctypes.addressof(b), ctypes.sizeof(b))
                   for slot in (0, 1) for b in table[ctypes.c_int(slot)])
    return np.frombuffer(raw, dtype=BATCH_DTYPE)


def _unbatch(batches: np.ndarray) -> np.ndarray:
    """Flat completion records from batches, each holding its first `n` events."""
    keep = np.arange(batches["ev"].shape[1]) < batches["n"][:, None]
    return batches["ev"][keep]


def _name_threads(records: np.ndarray, comms: Any) -> None:
    """Fill the records' comm from the thread names the programs kept by tid."""
    names = {int(k.value): bytes(v.comm) for k, v in comms.items()}
    if names:
        records["comm"] = pd.Series(records["tid"]).map(names).fillna(b"").to_numpy("S16")


def _open_slots(bpf: Any) -> np.ndarray:
    """Requests of the rq keying issued and not completed when the probe stopped (slots and
    spill table), as SLOT_DTYPE records."""
    slots = bpf[b"slots"]
    raw = [ctypes.string_at(ctypes.addressof(v), ctypes.sizeof(v))
           for v in (*slots.values(), *bpf[b"spill"].values())]
    table = np.frombuffer(b"".join(raw), dtype=SLOT_DTYPE)
    return table[(table["rq"] != 0) & (table["issue_ns"] != 0)]


def _open_requests(bpf: Any) -> np.ndarray:
    """The same for the dev_sector keying's request table."""
    rows = [(r.dev, r.issue_ns, r.tracked, OPS.index(frames.op_from_rwbs(
        bytes(r.rwbs).split(b"\0")[0].decode(errors="replace"))))
        for r in bpf[b"reqs"].values() if r.issue_ns]
    return np.array(rows, dtype=[("dev", "<u4"), ("issue_ns", "<u8"), ("tracked", "<u4"),
                                 ("op", "<u4")])
