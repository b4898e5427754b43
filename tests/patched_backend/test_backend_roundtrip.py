# SPDX-License-Identifier: Apache-2.0
"""KV bit-exact through the plugin inside a real LMCache StorageManager, on real files."""

import pytest

from kvscope.testkit.lmcache_harness import assert_exact

MODES = [
    pytest.param({"kvscope.mode": "parallel", "kvscope.read_unit": "64KiB"}, id="parallel"),
    pytest.param({"kvscope.mode": "serial"}, id="serial"),
]


@pytest.mark.parametrize("knobs", MODES)
def test_batched_get_is_bit_exact(harness, knobs):
    h = harness(**knobs)
    h.put(list(range(6)))
    assert_exact(h.get(list(range(6))), list(range(6)))
    stats = h.backend.stats()
    assert stats["read_hits"] == 6 and stats["stores"] == 6 and stats["corrupt_chunks"] == 0
    assert stats["odirect"], "reads fell back to buffered I/O on this file system"
