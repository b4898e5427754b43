# SPDX-License-Identifier: Apache-2.0
"""LMCache's pool moved to transparent huge pages: real madvise on real memory, same bytes."""

from pathlib import Path

import pytest
import torch

from kvscope.patched_backend.parallel_disk.buffers import HUGE_PAGE, collapse_to_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_around(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are disabled on this kernel")
def test_collapse_moves_touched_memory_to_huge_pages_keeping_its_bytes():
    pool = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)  # touched: 4 KiB pages
    before = pool.clone()
    done, error = collapse_to_huge_pages(pool.data_ptr(), pool.numel())
    assert done >= (64 << 20) - 2 * HUGE_PAGE
    if error:
        pytest.skip(f"kernel without MADV_COLLAPSE: {error}")
    assert _huge_kib_around(pool.data_ptr() + HUGE_PAGE) >= (32 << 20) >> 10
    assert torch.equal(pool, before)


def test_region_smaller_than_a_huge_page_is_left_alone():
    assert collapse_to_huge_pages(HUGE_PAGE + 4096, 4096) == (0, "smaller than one huge page")
