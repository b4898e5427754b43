# SPDX-License-Identifier: Apache-2.0
"""Destination memory for O_DIRECT reads.

LMCache's CPU allocator hands out 4 KiB-aligned blocks whose physical size is rounded up to
4 KiB (``AddressManager.ALIGN_BYTES``), so the padded payload can be read straight into the
memory object: zero copies. When a memory object is not aligned or too small (another
allocator), the read goes to an aligned anonymous mapping and is copied after verification.
"""

import ctypes
import mmap
import os
from typing import Any, Optional

import torch

from kvscope.patched_backend.parallel_disk.chunkfile import ALIGN, padded


def raw_view(address: int, nbytes: int) -> memoryview:
    """Writable byte view of ``nbytes`` at ``address`` (the owner must outlive it)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def direct_view(data_ptr: int, physical_size: int, payload_len: int) -> Optional[memoryview]:
    """View over a memory object's block for a direct read, or None if it cannot take one."""
    need = padded(payload_len)
    if data_ptr % ALIGN or physical_size < need:
        return None
    return raw_view(data_ptr, need)


def staging_buffer(payload_len: int) -> memoryview:
    """Page-aligned private anonymous buffer of the padded payload size, huge pages advised.

    Private (not Python's default shared) mapping so transparent huge pages apply: with 4 KiB
    pages a virtio-blk request (254 segments) carries at most ~1 MiB, with 2 MiB pages 4 MiB.
    """
    mm = mmap.mmap(-1, padded(payload_len), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(mm)


_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1+
HUGE_PAGE = 2 << 20


def pool_region(allocator_backend: Any) -> Optional[tuple[int, int]]:
    """(address, bytes) of LMCache's CPU memory pool, None when it is not a plain CPU buffer."""
    buffer = getattr(getattr(allocator_backend, "memory_allocator", None), "buffer", None)
    if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
        return None
    return buffer.data_ptr(), buffer.numel() * buffer.element_size()


def collapse_to_huge_pages(address: int, nbytes: int) -> tuple[int, str]:
    """Back ``[address, address + nbytes)`` with transparent huge pages; (bytes, error or "").

    Why: LMCache's pool is ordinary 4 KiB-page memory (torch.empty, touched at start-up). An
    O_DIRECT request into it is cut at the device's segment limit (virtio here: 254 segments,
    ~1 MiB); into 2 MiB pages it can carry 4 MiB, which the device serves faster. The memory
    and its contents stay the same; ``MADV_COLLAPSE`` copies the pages into huge pages now
    (ranges under I/O at that moment are skipped by the kernel, not damaged). Without it
    (kernel < 6.1) ``MADV_HUGEPAGE`` lets khugepaged do it later.
    """
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return 0, "smaller than one huge page"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, end - start, _MADV_HUGEPAGE) != 0:
        return 0, f"MADV_HUGEPAGE: {os.strerror(ctypes.get_errno())}"
    if libc.madvise(start, end - start, _MADV_COLLAPSE) != 0:
        return end - start, f"MADV_COLLAPSE: {os.strerror(ctypes.get_errno())} (khugepaged later)"
    return end - start, ""
