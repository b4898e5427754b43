# SPDX-License-Identifier: Apache-2.0
"""Pure conversions from probe records to the run directory's tables (no BPF, testable anywhere).

Column meanings: docs/run-directory.md (block_io, queue_depth).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pandas as pd

# blk_status_t -> errno, as the kernel's blk_errors[] table maps them (include/linux/blk_types.h).
BLK_STATUS_ERRNO = {
    0: 0, 1: errno.EOPNOTSUPP, 2: errno.ETIMEDOUT, 3: errno.ENOSPC, 4: errno.ENOLINK,
    5: errno.EREMOTEIO, 6: errno.EBADE, 7: errno.ENODATA, 8: errno.EILSEQ, 9: errno.ENOMEM,
    10: errno.EIO, 12: errno.EAGAIN, 13: errno.EBUSY,
}


def split_dev(dev: int) -> tuple[int, int]:
    """Kernel-internal dev_t (as tracepoints report it): 12-bit major, 20-bit minor."""
    return dev >> 20, dev & 0xFFFFF


def dev_string(dev: int) -> str:
    major, minor = split_dev(dev)
    return f"{major}:{minor}"


def device_name(dev: int, sys_root: Path = Path("/sys")) -> str:
    """Disk name of a dev_t (`vda`, `loop3`), or `major:minor` when sysfs does not know it."""
    link = sys_root / "dev" / "block" / dev_string(dev)
    try:
        return os.path.basename(os.readlink(link))
    except OSError:
        return dev_string(dev)


def op_from_rwbs(rwbs: str) -> str:
    """Operation letter of a blktrace rwbs string: a leading F before R/W/D is a pre-flush flag."""
    if len(rwbs) > 1 and rwbs[0] == "F" and rwbs[1] in "RWD":
        rwbs = rwbs[1:]
    return rwbs[0] if rwbs and rwbs[0] in "RWFD" else "O"


def error_errno(raw: np.ndarray, from_status: bool) -> np.ndarray:
    """Negative errno per request; raw tracepoints report -blk_status_t, classic ones -errno."""
    if not from_status:
        return raw.astype("int64")
    return np.array([-BLK_STATUS_ERRNO.get(-int(v), errno.EIO) for v in raw], dtype="int64")


def block_frame(events: np.ndarray, phase: str, *, from_status: bool,
                sys_root: Path = Path("/sys")) -> pd.DataFrame:
    """block_io rows for the tracked (pid-filter-passing) records of the block probe."""
    ev = events[events["tracked"] == 1]
    names = {int(d): device_name(int(d), sys_root) for d in np.unique(ev["dev"])}
    rwbs = [r.decode(errors="replace") for r in ev["rwbs"]]
    start = _or_unknown(ev["start_ns"])
    return pd.DataFrame(
        {
            "phase": phase,
            "device": [names[int(d)] for d in ev["dev"]],
            "dev": [dev_string(int(d)) for d in ev["dev"]],
            "sector": ev["sector"].astype("int64"),
            "bytes": ev["bytes"].astype("int64"),
            "op": [op_from_rwbs(r) for r in rwbs],
            "pid": np.where(start > 0, ev["tgid"].astype("int64"), -1),
            "tid": np.where(start > 0, ev["tid"].astype("int64"), -1),
            "comm": [c.decode(errors="replace") for c in ev["comm"]],
            "start_ns": start,
            "insert_ns": _or_unknown(ev["insert_ns"]),
            "issue_ns": _or_unknown(ev["issue_ns"]),
            "complete_ns": ev["complete_ns"].astype("int64"),
            "error": error_errno(ev["error"], from_status),
        }
    )


def _or_unknown(stamps: np.ndarray) -> np.ndarray:
    """Kernel timestamps as int64, 0 (never stamped) as -1."""
    return np.where(stamps > 0, stamps.astype("int64"), -1)


def log2_slots(ns: np.ndarray) -> np.ndarray:
    """bcc's bpf_log2l(ns / 1000): slot k holds [2^(k-1), 2^k) us, slot 1 also 0 us."""
    us = ns.astype("int64") // 1000
    return np.maximum(np.frexp(us.astype("float64"))[1].astype("int64"), 1)


def log2_histograms(events: np.ndarray) -> dict[str, dict[int, dict[int, int]]]:
    """`queue_us` (start -> issue) and `service_us` (issue -> complete) per dev_t, in log2
    microsecond slots, over the tracked requests that were issued (and started, for queue)."""
    ev = events[(events["tracked"] == 1) & (events["issue_ns"] > 0)]
    queued = ev[ev["start_ns"] > 0]
    parts = {"queue_us": (queued, queued["issue_ns"] - queued["start_ns"]),
             "service_us": (ev, ev["complete_ns"] - ev["issue_ns"])}
    out: dict[str, dict[int, dict[int, int]]] = {}
    for kind, (rows, ns) in parts.items():
        table = pd.DataFrame({"dev": rows["dev"].astype("int64"), "slot": log2_slots(ns)})
        counts = table.groupby(["dev", "slot"]).size().reset_index(name="n")
        per_dev: dict[int, dict[int, int]] = {}
        for dev, slot, n in counts.itertuples(index=False):
            per_dev.setdefault(int(dev), {})[int(slot)] = int(n)
        out[kind] = per_dev
    return out


def depth_series(steps: pd.DataFrame, phase: str) -> pd.DataFrame:
    """queue_depth rows (source bpf) from +1/-1 steps with columns ts_ns, device, hw_queue, delta.

    Each step becomes one row holding the in-flight count after it; counting starts at zero when
    the probe attached, so requests already in flight then are not counted.
    """
    ordered = steps.sort_values(["ts_ns", "delta"], kind="stable", ignore_index=True)
    inflight = ordered.groupby(["device", "hw_queue"], sort=False)["delta"].cumsum()
    return pd.DataFrame(
        {
            "phase": phase,
            "ts_ns": ordered["ts_ns"].astype("int64"),
            "device": ordered["device"].astype(str),
            "hw_queue": ordered["hw_queue"].astype("int64"),
            "inflight": inflight.astype("int64"),
            "source": "bpf",
        }
    )


def block_steps(events: np.ndarray, open_issues: list[tuple[int, int]],
                sys_root: Path = Path("/sys")) -> pd.DataFrame:
    """Depth steps of every request issued on the probed devices (pid filter or not).

    `open_issues` are (dev, issue_ns) of requests still in flight when the probe stopped.
    """
    events = events[events["issue_ns"] > 0]  # a request finished unissued held no place
    still = np.array(open_issues, dtype="int64").reshape(-1, 2)
    devs = np.concatenate([events["dev"].astype("int64"), still[:, 0]])
    issues = np.concatenate([events["issue_ns"].astype("int64"), still[:, 1]])
    names = {int(d): device_name(int(d), sys_root) for d in np.unique(devs)}
    up = pd.DataFrame({"ts_ns": issues, "dev": devs, "delta": 1})
    down = pd.DataFrame(
        {"ts_ns": events["complete_ns"].astype("int64"), "dev": events["dev"].astype("int64"),
         "delta": -1}
    )
    steps = pd.concat([up, down], ignore_index=True)
    steps["device"] = steps["dev"].map(names)
    steps["hw_queue"] = -1
    return steps
