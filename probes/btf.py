# SPDX-License-Identifier: Apache-2.0
"""Byte offsets of the few kernel struct fields the block probe reads, taken from the running
kernel's BTF (/sys/kernel/btf/vmlinux via bpftool), so no header tree has to match the kernel.

bcc 0.26 has no CO-RE for its C programs; these offsets are its hand-made relocations.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")
# struct -> fields the per-I/O programs read (request -> q -> disk -> major/first_minor; the
# request's tags and hardware queue place its slot)
NEEDED = {
    "request": ("q", "cmd_flags", "rq_flags", "__data_len", "__sector", "tag", "internal_tag",
                "mq_hctx"),
    "blk_mq_hw_ctx": ("queue_num",),
    "request_queue": ("disk",),
    "gendisk": ("major", "first_minor"),
}
# The aggregate probe also reads the kernel's own request timestamps at completion.
AGGREGATE_NEEDED = {**NEEDED, "request": (*NEEDED["request"], "start_time_ns", "io_start_time_ns")}

_MEMBER = re.compile(r"^\s+'([^']+)' type_id=\d+ bits_offset=(\d+)")
_ENUMERATOR = re.compile(r"^\s+'([^']+)' val=(-?\d+)")


class BtfError(RuntimeError):
    """The kernel's BTF cannot give the offsets; the message says what is missing."""


def struct_offsets(dump: str, needed: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """`STRUCT_FIELD -> byte offset` (e.g. REQUEST___SECTOR) from `bpftool btf dump ... raw`.

    Searches the text for each struct header (str.find, fast on the ~20 MB dump) and reads only
    its member lines; the first definition with a non-zero size wins.
    """
    found: dict[str, int] = {}
    for struct, fields in needed.items():
        at = dump.find(f"] STRUCT '{struct}' size=")
        while at >= 0 and dump.startswith("0 ", dump.find("size=", at) + 5):
            at = dump.find(f"] STRUCT '{struct}' size=", at + 1)
        if at < 0:
            continue
        header_end = dump.find("\n", at)
        vlen = int(dump[dump.rfind("vlen=", at, header_end) + 5:header_end])
        for line in dump[header_end + 1:].split("\n", vlen)[:vlen]:
            member = _MEMBER.match(line)
            if member and member.group(1) in fields:
                found[f"{struct}_{member.group(1)}".upper()] = int(member.group(2)) // 8
    wanted = {f"{s}_{f}".upper() for s, fields in needed.items() for f in fields}
    missing = sorted(wanted - set(found))
    if missing:
        raise BtfError(f"kernel BTF lacks struct fields {missing}")
    return found


@functools.cache
def _vmlinux_dump() -> str:
    """The running kernel's BTF as text (once per process; the kernel cannot change under it)."""
    if not VMLINUX_BTF.exists():
        raise BtfError(f"{VMLINUX_BTF} is missing (kernel built without CONFIG_DEBUG_INFO_BTF)")
    try:
        return subprocess.run(["bpftool", "btf", "dump", "file", str(VMLINUX_BTF), "format", "raw"],
                              check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BtfError(f"bpftool cannot dump {VMLINUX_BTF} ({e}); install Debian's bpftool") from e


def kernel_offsets(needed: dict[str, tuple[str, ...]] = NEEDED) -> dict[str, int]:
    """Offsets for `needed` (NEEDED or AGGREGATE_NEEDED) on the running kernel; BtfError if
    BTF, bpftool or a field is missing."""
    return struct_offsets(_vmlinux_dump(), needed)


def enum_value(dump: str, enum: str, name: str) -> int | None:
    """Value of enumerator `name` of enum `enum` in `bpftool btf dump ... raw` text, None when
    the kernel has no such enum (it may be a #define there)."""
    at = dump.find(f"] ENUM '{enum}' ")
    if at < 0:
        return None
    header_end = dump.find("\n", at)
    vlen = int(dump[dump.rfind("vlen=", at, header_end) + 5:header_end])
    for line in dump[header_end + 1:].split("\n", vlen)[:vlen]:
        member = _ENUMERATOR.match(line)
        if member and member.group(1) == name:
            return int(member.group(2))
    return None


def kernel_flush_seq_bit() -> int:
    """Bit of RQF_FLUSH_SEQ in struct request's rq_flags on the running kernel, -1 when its
    BTF does not say (rq_flags an enum since ~6.8)."""
    bit = enum_value(_vmlinux_dump(), "rqf_flags", "__RQF_FLUSH_SEQ")
    return -1 if bit is None else bit


def tracepoint_type_ids(dump: str, tracepoints: tuple[str, ...]) -> dict[str, int]:
    """BTF type id of each tracepoint's `btf_trace_<name>` typedef in `bpftool btf dump ...
    raw` text: what a tp_btf program is bound to (probes/tp_btf.py)."""
    found = {}
    for name in tracepoints:
        at = dump.find(f"] TYPEDEF 'btf_trace_{name}' ")
        if at < 0:
            raise BtfError(f"kernel BTF has no btf_trace_{name} (tracepoint block:{name} is "
                           f"missing or not BTF-typed)")
        found[name] = int(dump[dump.rfind("[", 0, at) + 1:at])
    return found


def kernel_tracepoint_ids(tracepoints: tuple[str, ...]) -> dict[str, int]:
    """tracepoint_type_ids on the running kernel."""
    return tracepoint_type_ids(_vmlinux_dump(), tracepoints)
