# SPDX-License-Identifier: Apache-2.0
"""What this host lets the probes do, found by probing features (never by kernel version).

`detect()` returns either a Plan (which tracepoints and keying to use) or a Fallback naming
what is missing and how to fix it, so the caller can say so and run the sysfs sampler.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.probes.block_bpf import RQ_PROGRAMS
from kvscope.probes.btf import BtfError, kernel_flush_seq_bit, kernel_offsets, kernel_tracepoint_ids

TRACEFS_ROOTS = (Path("/sys/kernel/debug/tracing"), Path("/sys/kernel/tracing"))
NVME_TRACEPOINTS = ("nvme_setup_cmd", "nvme_complete_rq")
CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39  # include/uapi/linux/capability.h


@dataclass(frozen=True)
class Plan:
    """The best BPF set-up available: keying, start event, and whether NVMe can be traced."""

    key: str  # "rq" or "dev_sector"
    start_tracepoint: str
    nvme: bool
    tracepoints: list[str] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)  # kernel struct offsets (rq only)
    note: str = ""  # why a lesser keying was chosen, "" for the best one
    attach: str = "tp_btf"  # rq key: "tp_btf", or "raw_tp" when tracepoints are not BTF-typed
    flush_seq_bit: int = -1  # rq key: bit of RQF_FLUSH_SEQ in rq_flags, -1 unknown


@dataclass(frozen=True)
class Fallback:
    """Why BPF cannot run here and what the user should do about it."""

    why: str
    fix: str

    def message(self) -> str:
        return (f"kvscope probes: {self.why}; using the /proc/diskstats + /sys/block/*/inflight "
                f"sampler instead (no per-request rows). To fix: {self.fix}")


def _tracefs() -> Path | None:
    return next((root for root in TRACEFS_ROOTS if (root / "events").is_dir()), None)


def _headers_found() -> bool:
    """bcc's own search order: BCC_KERNEL_SOURCE, /lib/modules/<release>/{source,build}, kheaders."""
    modules = Path("/lib/modules") / platform.release()
    candidates = [os.environ.get("BCC_KERNEL_SOURCE", ""), str(modules / "build"),
                  str(modules / "source")]
    if any(c and (Path(c) / "include" / "linux" / "kconfig.h").exists() for c in candidates):
        return True
    return Path("/sys/kernel/kheaders.tar.xz").exists()


def _can_load_bpf(status: str) -> bool:
    """CapEff of /proc/self/status holds CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN."""
    line = next(ln for ln in status.splitlines() if ln.startswith("CapEff:"))
    caps = int(line.split()[1], 16)
    has = lambda bit: bool(caps >> bit & 1)  # noqa: E731
    return has(CAP_SYS_ADMIN) or (has(CAP_BPF) and has(CAP_PERFMON))


def _environment_problem() -> Fallback | None:
    setup = "run `sudo bash scripts/setup.sh` (it runs scripts/setup.d/bcc.sh)"
    if not _can_load_bpf(Path("/proc/self/status").read_text()):
        return Fallback("not running as root: this process lacks CAP_BPF + CAP_PERFMON (or "
                        "CAP_SYS_ADMIN), which loading BPF programs needs",
                        "run kvscope as root, e.g. `sudo .venv/bin/kvscope ...`")
    try:
        import bcc  # noqa: F401
    except ImportError as e:
        return Fallback(f"the bcc Python module cannot be imported ({e})", setup)
    if _tracefs() is None:
        return Fallback("tracefs is not mounted", "`mount -t tracefs nodev /sys/kernel/tracing`")
    if not _headers_found():
        return Fallback(f"no kernel headers for {platform.release()} (bcc compiles against them)",
                        f"{setup}; it installs linux-headers-amd64 and links /lib/modules/"
                        f"{platform.release()}/build")
    return None


def detect() -> Plan | Fallback:
    """Pick the best tracepoint set this kernel has, or say why there is none."""
    problem = _environment_problem()
    if problem is not None:
        return problem
    from bcc import BPF

    has = {name: BPF.tracepoint_exists("block", name) for name in
           ("block_io_start", "block_getrq", "block_rq_insert", "block_rq_merge",
            "block_rq_issue", "block_rq_complete")}
    needed = ("block_rq_insert", "block_rq_merge", "block_rq_issue", "block_rq_complete")
    missing = [n for n in needed if not has[n]]
    if missing:
        return Fallback(f"tracepoints block:{', block:'.join(missing)} are missing",
                        "use a kernel built with CONFIG_TRACEPOINTS (every distribution kernel "
                        "is) and check that tracefs lists them under events/block")
    return _plan(BPF, has)


def _rq_offsets(bpf: Any, has: dict[str, bool]) -> tuple[dict[str, int], str]:
    """Struct offsets for request-pointer keying, or why that keying is out of reach."""
    if not bpf.support_raw_tracepoint():
        return {}, "the kernel has no raw tracepoints"
    if not has["block_io_start"]:
        return {}, "block:block_io_start (6.5+) is missing"
    try:
        return kernel_offsets(), ""
    except BtfError as e:
        return {}, str(e)


def _attach_kind() -> str:
    """tp_btf when the kernel's BTF types every block tracepoint the rq keying uses."""
    try:
        kernel_tracepoint_ids(tuple(dict.fromkeys(tp for tp, _ in RQ_PROGRAMS)))
    except BtfError:
        return "raw_tp"
    return "tp_btf"


def _plan(bpf: Any, has: dict[str, bool]) -> Plan | Fallback:
    offsets, note = _rq_offsets(bpf, has)
    attach, flush_seq_bit = "raw_tp", -1
    if offsets:
        key, start = "rq", "block_io_start"
        attach, flush_seq_bit = _attach_kind(), kernel_flush_seq_bit()
    elif has["block_io_start"] or has["block_getrq"]:
        key, start = "dev_sector", "block_io_start" if has["block_io_start"] else "block_getrq"
    else:
        return Fallback("neither block:block_io_start nor block:block_getrq exists",
                        "use a kernel with block:block_io_start (6.5+) or block:block_getrq")
    nvme = all(bpf.tracepoint_exists("nvme", n) for n in NVME_TRACEPOINTS)
    if key == "rq":
        tracepoints = [f"{attach}:block:{n}" for n in dict.fromkeys(tp for tp, _ in RQ_PROGRAMS)]
    else:
        tracepoints = [f"tp:block:{n}" for n in (start, "block_rq_insert", "block_rq_merge",
                                                 "block_rq_issue", "block_rq_complete")]
    if nvme:
        tracepoints += [f"tp:nvme:{n}" for n in NVME_TRACEPOINTS]
    note = f"keyed by (dev, sector) because {note}" if note else ""
    return Plan(key=key, start_tracepoint=start, nvme=nvme, tracepoints=tracepoints,
                offsets=offsets, note=note, attach=attach, flush_seq_bit=flush_seq_bit)
