# SPDX-License-Identifier: Apache-2.0
"""Issue 14 item 1: a chunk is served only to the physical layout that wrote its bytes.

The CPU connector's chunks are raw vLLM-CPU blocks: their byte order changes with vLLM's block
size, so a restart with another ``--block-size`` on the same directory must miss (reason
``layout``, counted), not serve the old bytes. vLLM's real config objects set the block size
around the backend's construction, as vLLM's worker does.
"""

import os
from contextlib import contextmanager
from typing import Iterator

import pytest

from kvscope.patched_backend.parallel_disk import layout
from kvscope.testkit.lmcache_harness import assert_exact, chunk_path, metadata


@contextmanager
def vllm_block_size(block_size: int) -> Iterator[None]:
    """vLLM's current config with this block size, as in the worker's KV cache set-up."""
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(cache_config=CacheConfig(block_size=block_size))):
        yield


def _cpu_connector() -> None:
    """Build kvscope's real CPU connector: it registers itself as the writer of the bytes."""
    from kvscope.patched_backend.vllm_cpu.connector import CPUPagedKVConnector

    CPUPagedKVConnector.from_metadata(metadata())


def test_restart_with_another_block_size_is_a_counted_miss(harness, tmp_path):
    _cpu_connector()
    with vllm_block_size(128):
        first = harness()
    first.put([0, 1])
    first.close()
    with vllm_block_size(32):
        second = harness()
    stats = second.backend.stats()
    assert stats["chunks"] == 0
    assert stats["corrupt_by_reason"] == {"layout": 2}
    assert second.get([0, 1]) == [None, None]
    assert os.path.exists(chunk_path(tmp_path / "kv", 0))  # left for a later store to replace
    second.put([0])  # the new layout's chunk replaces the old file and is served
    assert_exact(second.get([0]), [0])


def test_restart_with_the_same_layout_hits(harness):
    _cpu_connector()
    with vllm_block_size(128):
        first = harness()
    first.put([0, 1])
    first.close()
    with vllm_block_size(128):
        second = harness()
    assert second.backend.stats()["corrupt_by_reason"] == {}
    assert_exact(second.get([0, 1]), [0, 1])


def test_chunks_of_another_writer_are_a_counted_miss(harness):
    first = harness()  # no CPU connector in the process: LMCache's canonical KV_2LTD bytes
    first.put([0])
    first.close()
    _cpu_connector()
    second = harness()
    assert second.backend.stats()["corrupt_by_reason"] == {"layout": 1}
    assert second.get([0]) == [None]


def test_layout_identity_names_writer_block_size_and_model():
    _cpu_connector()
    with vllm_block_size(32):
        from vllm.config import get_current_vllm_config

        identity = layout.engine_layout(metadata(), get_current_vllm_config())
    assert identity["writer"] == "kvscope-cpu-blocks" and identity["writer_version"] == 1
    assert identity["block_size"] == 32 and identity["kv_shape"] == [4, 2, 256, 2, 64]
    assert identity["kv_dtype"] == "torch.bfloat16" and "packing" in identity
    assert identity["vllm"]  # the kernels' packing may change between vLLM versions
