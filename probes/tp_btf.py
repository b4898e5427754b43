# SPDX-License-Identifier: Apache-2.0
"""Load and attach BTF-typed tracepoint programs (`tp_btf`) compiled by bcc.

bcc 0.26 attaches raw tracepoint programs only, which read kernel memory through
bpf_probe_read_kernel (a helper call, ~45 ns each on this VM). A tp_btf program gets the
tracepoint's arguments typed by the kernel's BTF, so it loads struct fields directly (one
instruction each, checked by the verifier against BTF). bcc still compiles the C and creates
the maps; this module hands the compiled function to BPF_PROG_LOAD as a tracing program bound
to the tracepoint's `btf_trace_<name>` type, then opens it with BPF_RAW_TRACEPOINT_OPEN: a
tracepoint attachment, not a kprobe.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYS_BPF = 321  # x86_64
BPF_PROG_LOAD, BPF_RAW_TRACEPOINT_OPEN = 5, 17
BPF_PROG_TYPE_TRACING, BPF_TRACE_RAW_TP = 26, 23
LOG_BYTES = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)


class _ProgLoadAttr(ctypes.Structure):
    """The BPF_PROG_LOAD part of union bpf_attr (include/uapi/linux/bpf.h), up to
    attach_btf_obj_fd; the kernel takes zeroes for every later field."""

    _fields_ = [
        ("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64), ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32), ("prog_name", ctypes.c_char * 16),
        ("prog_ifindex", ctypes.c_uint32), ("expected_attach_type", ctypes.c_uint32),
        ("prog_btf_fd", ctypes.c_uint32), ("func_info_rec_size", ctypes.c_uint32),
        ("func_info", ctypes.c_uint64), ("func_info_cnt", ctypes.c_uint32),
        ("line_info_rec_size", ctypes.c_uint32), ("line_info", ctypes.c_uint64),
        ("line_info_cnt", ctypes.c_uint32), ("attach_btf_id", ctypes.c_uint32),
        ("attach_btf_obj_fd", ctypes.c_uint32), ("pad", ctypes.c_uint8 * 64),
    ]


class _RawTpOpenAttr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_uint64), ("prog_fd", ctypes.c_uint32),
                ("pad", ctypes.c_uint32), ("cookie", ctypes.c_uint64)]


def _bpf(cmd: int, attr: ctypes.Structure) -> int:
    fd = _libc.syscall(SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    return fd if fd >= 0 else -ctypes.get_errno()


def prog_id(fd: int) -> int:
    """The kernel id of the program behind a file descriptor (`bpftool prog show id N`)."""
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("prog_id:"):
            return int(line.split()[1])
    raise RuntimeError(f"fd {fd} is not a BPF program")


@dataclass
class Attached:
    """One program attached to one tracepoint (`name`: the program); detach() stops it
    firing and keeps it loaded (its run counts stay readable), close() also unloads it."""

    name: str
    prog_fd: int
    link_fd: int

    def prog_id(self) -> int:
        return prog_id(self.prog_fd)

    def detach(self) -> None:
        if self.link_fd >= 0:
            os.close(self.link_fd)
            self.link_fd = -1

    def close(self) -> None:
        self.detach()
        if self.prog_fd >= 0:
            os.close(self.prog_fd)
            self.prog_fd = -1


def attach(bpf: Any, func: str, btf_type_id: int, tracepoint: str) -> Attached:
    """Load bcc function `func` as a tp_btf program for the tracepoint whose `btf_trace_*`
    type id is `btf_type_id`, and attach it; OSError with the verifier's last lines if not."""
    from bcc.libbcc import lib

    name = func.encode()
    start = lib.bpf_function_start(bpf.module, name)
    if not start:
        raise ValueError(f"no function {func} in the compiled program")
    size = lib.bpf_function_size(bpf.module, name)
    log = ctypes.create_string_buffer(LOG_BYTES)
    license_ = ctypes.c_char_p(lib.bpf_module_license(bpf.module))
    attr = _ProgLoadAttr(
        prog_type=BPF_PROG_TYPE_TRACING, insn_cnt=size // 8,
        insns=ctypes.cast(start, ctypes.c_void_p).value,
        license=ctypes.cast(license_, ctypes.c_void_p).value,
        log_level=1, log_size=LOG_BYTES, log_buf=ctypes.addressof(log),
        prog_name=name[:15], expected_attach_type=BPF_TRACE_RAW_TP, attach_btf_id=btf_type_id,
    )
    prog_fd = _bpf(BPF_PROG_LOAD, attr)
    if prog_fd < 0:
        tail = "\n".join(log.value.decode(errors="replace").splitlines()[-8:])
        raise OSError(-prog_fd, f"loading {func} as tp_btf for {tracepoint} failed "
                                f"({os.strerror(-prog_fd)}): {tail}")
    link_fd = _bpf(BPF_RAW_TRACEPOINT_OPEN, _RawTpOpenAttr(name=0, prog_fd=prog_fd))
    if link_fd < 0:
        os.close(prog_fd)
        raise OSError(-link_fd, f"attaching {func} to tp_btf/{tracepoint} failed "
                                f"({os.strerror(-link_fd)})")
    return Attached(func, prog_fd, link_fd)


def attach_raw(bpf: Any, func: str, tracepoint: str) -> Attached:
    """Load bcc function `func` as a raw tracepoint program and attach it to `tracepoint`.
    Through libbcc, not BPF.attach_raw_tracepoint, which keeps one program per tracepoint."""
    from bcc import BPF
    from bcc.libbcc import lib

    fn = bpf.load_func(func.encode(), BPF.RAW_TRACEPOINT)
    prog_fd = os.dup(fn.fd)
    link_fd = lib.bpf_attach_raw_tracepoint(prog_fd, tracepoint.encode())
    if link_fd < 0:
        os.close(prog_fd)
        raise OSError(f"cannot attach {func} to raw tracepoint {tracepoint}")
    return Attached(func, prog_fd, link_fd)
