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
    """Page-aligned anonymous buffer of the padded payload size (freed with the view's mmap)."""
    return memoryview(mmap.mmap(-1, padded(payload_len)))
