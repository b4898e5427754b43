# SPDX-License-Identifier: Apache-2.0
"""Destination memory for O_DIRECT reads.

LMCache's CPU allocator hands out 4 KiB-aligned blocks whose physical size is rounded up to
4 KiB (``AddressManager.ALIGN_BYTES``), so the padded payload can be read straight into the
memory object: zero copies. When a memory object is not aligned or too small (another
allocator), the read goes to an aligned anonymous mapping and is copied after verification.
"""

# Standard
from typing import Optional
import ctypes
import mmap

# First Party
from patched_backend.parallel_disk.chunkfile import ALIGN, padded


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
