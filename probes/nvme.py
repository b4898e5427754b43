# SPDX-License-Identifier: Apache-2.0
"""The NVMe probe: per-command rows, per hardware queue depth, latency per queue and opcode.

Setup and completion records are joined on (ctrl_id, qid, cid & 0xfff): since ~5.14 the host
puts a 4-bit generation counter in the top bits of the command id at setup while the completion
tracepoint logs the bare tag. Each controller is labelled with its transport from sysfs
(pcie, tcp, rdma, fc, loop) so NVMe-oF queues are told apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvscope.contract.rundir import TABLES
from kvscope.probes import frames
from kvscope.probes.lifecycle import Probe
from kvscope.probes.nvme_bpf import COMPLETE, NVME_DTYPE, SETUP, NvmeOptions, render

CID_TAG_MASK = 0x0FFF
IO_READ, IO_WRITE = 0x02, 0x01


def events_frame(records: np.ndarray) -> pd.DataFrame:
    """Raw probe records as a frame, with cdw10..15 decoded into slba and nlb (0-based + 1)."""
    dwords = records["cdw10"].reshape(-1, 24).copy().view("<u4").reshape(-1, 6).astype("int64")
    return pd.DataFrame(
        {
            "ts_ns": records["ts_ns"].astype("int64"),
            "kind": records["kind"].astype("int64"),
            "ctrl_id": records["ctrl_id"].astype("int64"),
            "qid": records["qid"].astype("int64"),
            "cid": records["cid"].astype("int64"),
            "tag": records["cid"].astype("int64") & CID_TAG_MASK,
            "opcode": records["opcode"].astype("int64"),
            "nsid": records["nsid"].astype("int64"),
            "status": records["status"].astype("int64"),
            "slba": dwords[:, 0] | (dwords[:, 1] << 32),
            "nlb": (dwords[:, 2] & 0xFFFF) + 1,
            "disk": [d.decode(errors="replace") for d in records["disk"]],
        }
    )


def join_commands(events: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, int]]:
    """One row per completed command: each completion takes the setup just before it on its key.

    Returns the commands, the setups still open at the end (in flight when the probe stopped),
    and counts of setups without completion (open, or set up again after a failed queue_rq)
    and of completions without setup (in flight when the probe started).
    """
    ordered = events.sort_values(["ts_ns", "kind"], kind="stable", ignore_index=True)
    by_key = ordered.groupby(["ctrl_id", "qid", "tag"], sort=False)
    prev, nxt = by_key.shift(1), by_key.shift(-1)
    is_pair = (ordered["kind"] == COMPLETE) & (prev["kind"] == SETUP)
    setups = prev[is_pair]
    done = ordered[is_pair]
    commands = pd.DataFrame(
        {
            "ctrl_id": done["ctrl_id"], "qid": done["qid"], "cid": done["tag"],
            "opcode": setups["opcode"].astype("int64"), "nsid": setups["nsid"].astype("int64"),
            "slba": setups["slba"].astype("int64"), "nlb": setups["nlb"].astype("int64"),
            "disk": setups["disk"], "setup_ns": setups["ts_ns"].astype("int64"),
            "complete_ns": done["ts_ns"], "status": done["status"],
        }
    ).reset_index(drop=True)
    still_open = ordered[(ordered["kind"] == SETUP) & nxt["kind"].isna()]
    n_setup = int((ordered["kind"] == SETUP).sum())
    n_complete = int((ordered["kind"] == COMPLETE).sum())
    unmatched = {"setup_without_completion": n_setup - len(commands),
                 "completion_without_setup": n_complete - len(commands)}
    return commands, still_open, unmatched


def transports(sys_root: Path = Path("/sys")) -> dict[int, str]:
    """Controller number -> transport, from /sys/class/nvme/nvmeX/transport."""
    out = {}
    for node in (sys_root / "class" / "nvme").glob("nvme*"):
        if node.name[4:].isdigit() and (node / "transport").exists():
            out[int(node.name[4:])] = (node / "transport").read_text().strip()
    return out


def _lba_bytes(disk: str, sys_root: Path) -> int:
    path = sys_root / "block" / disk / "queue" / "logical_block_size"
    return int(path.read_text()) if disk and path.exists() else 512


def nvme_frame(commands: pd.DataFrame, phase: str, sys_root: Path = Path("/sys")) -> pd.DataFrame:
    """nvme_io rows: read/write bytes = NLB x the namespace's logical block size."""
    kinds = transports(sys_root)
    lba = {d: _lba_bytes(d, sys_root) for d in commands["disk"].unique()}
    io = (commands["qid"] > 0) & commands["opcode"].isin([IO_READ, IO_WRITE])
    frame = commands.assign(
        phase=phase,
        transport=commands["ctrl_id"].map(lambda c: kinds.get(int(c), "unknown")),
        bytes=np.where(io, commands["nlb"] * commands["disk"].map(lba), 0).astype("int64"),
    )
    return frame[TABLES["nvme_io"].columns].reset_index(drop=True)


def nvme_steps(commands: pd.DataFrame, still_open: pd.DataFrame) -> pd.DataFrame:
    """Depth steps per (controller, I/O queue); the admin queue (qid 0) is left out."""
    def steps(frame: pd.DataFrame, ts: str, delta: int) -> pd.DataFrame:
        io = frame[frame["qid"] > 0]
        return pd.DataFrame({"ts_ns": io[ts], "device": "nvme" + io["ctrl_id"].astype(str),
                             "hw_queue": io["qid"], "delta": delta})

    return pd.concat([steps(commands, "setup_ns", 1), steps(still_open, "ts_ns", 1),
                      steps(commands, "complete_ns", -1)], ignore_index=True)


def nvme_summary(nvme_io: pd.DataFrame, depth: pd.DataFrame) -> list[dict[str, Any]]:
    """Per (controller, transport, queue, opcode): commands, bytes, latency and peak depth."""
    latency_us = (nvme_io["complete_ns"] - nvme_io["setup_ns"]) / 1e3
    groups = nvme_io.assign(latency_us=latency_us).groupby(
        ["ctrl_id", "transport", "qid", "opcode"], as_index=False
    ).agg(commands=("cid", "size"), bytes=("bytes", "sum"), mean_us=("latency_us", "mean"),
          p50_us=("latency_us", "median"), p99_us=("latency_us", lambda s: s.quantile(0.99)),
          max_us=("latency_us", "max"))
    peaks = depth.groupby(["device", "hw_queue"])["inflight"].max()
    groups["max_inflight"] = [
        int(peaks.get((f"nvme{c}", q), 0)) for c, q in zip(groups["ctrl_id"], groups["qid"])
    ]
    return [{str(k): v for k, v in row.items()} for row in groups.to_dict(orient="records")]


@dataclass
class NvmeResult:
    """What one NVMe probe session saw, ready for the run directory."""

    nvme_io: pd.DataFrame
    queue_depth: pd.DataFrame  # per hardware queue
    summary: dict[str, Any]  # manifest: unmatched setups / completions, per-queue latency
    lost_events: dict[str, int]


class NvmeProbe(Probe[NvmeResult]):
    """Attach to nvme:nvme_setup_cmd / nvme_complete_rq; start() and stop() are idempotent."""

    def __init__(self, opts: NvmeOptions = NvmeOptions()) -> None:
        super().__init__()
        self.opts = opts
        self._records = np.zeros(0, dtype=NVME_DTYPE)
        self._lost: dict[str, int] = {}

    def program_text(self) -> str:
        return render(self.opts)

    def _rings(self) -> dict[str, np.dtype]:
        return {"nvme_events": NVME_DTYPE}

    def _drain(self, bpf: Any, records: dict[str, np.ndarray], bad_sizes: dict[str, int]) -> None:
        self._records = records["nvme_events"]
        self._lost = {"nvme_ringbuf_full": int(bpf[b"nvme_lost"][0].value),
                      "nvme_bad_record_size": bad_sizes["nvme_events"]}

    def _result(self, phase: str) -> NvmeResult:
        return decode(self._records, phase, lost_events=self._lost)


def decode(records: np.ndarray, phase: str, sys_root: Path = Path("/sys"),
           lost_events: dict[str, int] | None = None) -> NvmeResult:
    """Everything the run directory gets from a batch of NVMe probe records."""
    commands, still_open, unmatched = join_commands(events_frame(records))
    rows = nvme_frame(commands, phase, sys_root)
    depth = frames.depth_series(nvme_steps(commands, still_open), phase)
    return NvmeResult(rows, depth, {"unmatched": unmatched, "per_queue": nvme_summary(rows, depth)},
                      dict(lost_events or {}))
