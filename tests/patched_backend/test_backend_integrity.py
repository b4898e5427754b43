# SPDX-License-Identifier: Apache-2.0
"""Durable index and damaged files: cold hits after restart; bad chunks are misses, never KV."""

import os
import struct

import pytest

from kvscope.patched_backend.parallel_disk.chunkfile import HEADER_SIZE, VERSION
from kvscope.testkit.lmcache_harness import CHUNK, assert_exact, chunk_path, kv_tensor


def _flip_payload_byte(path: str, offset: int = 1234) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + offset)
        byte = f.read(1)
        f.seek(HEADER_SIZE + offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 8192)


def _replace_with_foreign(path: str) -> None:
    tmp = path + ".new"
    with open(tmp, "wb") as f:
        f.write(b"not a kvscope chunk".ljust(os.path.getsize(path), b"\0"))
    os.replace(tmp, path)


def _older_format_version(path: str) -> None:
    """Version 2 (CRC32C) chunk files are not read by version 3: a miss, not an error."""
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", VERSION - 1))


DAMAGE = [
    pytest.param(_flip_payload_byte, "checksum", id="corrupt-payload"),
    pytest.param(_truncate, "truncated", id="truncated"),
    pytest.param(os.unlink, "missing", id="missing"),
    pytest.param(_replace_with_foreign, "replaced", id="foreign"),
]


def test_restart_then_cold_hit(harness, tmp_path):
    first = harness()
    first.put([0, 1, 2])
    first.close()
    second = harness()
    assert second.backend.stats()["chunks"] == 3
    assert [second.backend.contains(k) for k in _keys(3)] == [True] * 3
    assert_exact(second.get([0, 1, 2]), [0, 1, 2])


@pytest.mark.parametrize(("damage", "reason"), DAMAGE)
def test_damaged_chunk_while_running_is_a_miss(harness, tmp_path, damage, reason):
    h = harness()
    h.put([0, 1, 2])
    damage(chunk_path(tmp_path / "kv", 1))
    objs = h.get([0, 1, 2])
    assert objs[1] is None and objs[2] is None  # LMCache serves a prefix only
    assert_exact(objs[:1], [0])
    stats = h.backend.stats()
    assert stats["corrupt_by_reason"] == {reason: 1}
    assert not h.backend.contains(_keys(2)[1])  # dropped from the index: recompute next time


@pytest.mark.parametrize(("damage", "reason"), [
    pytest.param(_flip_payload_byte, "checksum", id="corrupt-payload"),
    pytest.param(_truncate, "truncated", id="truncated"),
    pytest.param(_replace_with_foreign, "foreign", id="foreign"),
    pytest.param(_older_format_version, "format_version", id="older-format-version"),
])
def test_damaged_chunk_after_restart_is_never_served(harness, tmp_path, damage, reason):
    first = harness()
    first.put([0, 1])
    first.close()
    damage(chunk_path(tmp_path / "kv", 0))
    second = harness()
    objs = second.get([0, 1])
    assert objs[0] is None
    assert second.backend.stats()["corrupt_by_reason"] == {reason: 1}
    assert_exact(second.get([1]), [1])


def test_chunk_of_other_geometry_is_refused_as_foreign(harness, tmp_path):
    first = harness()
    first.put([0])
    first.close()
    second = harness(layers=8)  # same model name and key, different KV geometry
    assert second.backend.stats()["chunks"] == 0
    assert second.backend.stats()["corrupt_by_reason"] == {"foreign": 1}
    assert second.get([0]) == [None]


def test_unfull_chunk_roundtrip_keeps_shape(harness):
    h = harness(save_unfull_chunk=True)
    h.put([7], tokens=CHUNK - 55)
    [obj] = h.get([7])
    assert tuple(obj.tensor.shape) == tuple(kv_tensor(7, tokens=CHUNK - 55).shape)
    assert_exact([obj], [7], tokens=CHUNK - 55)


def _keys(n):
    from kvscope.testkit.lmcache_harness import key

    return [key(i) for i in range(n)]


@pytest.mark.parametrize("knobs", [
    *[pytest.param({"kvscope.read_unit": unit}, id=unit) for unit in ("64KiB", "1MiB", "4MiB")],
    pytest.param({"kvscope.mode": "serial"}, id="serial-128KiB"),
])
def test_corruption_in_any_hash_block_is_caught(harness, tmp_path, knobs):
    """2 MiB chunks = two 1 MiB hash blocks; sub-reads smaller than, equal to, larger than one,
    and serial mode's 128 KiB reads one after another (a block wider than one read is checked
    when the chunk's last read lands, before the chunk is served)."""
    h = harness(layers=16, **knobs)
    h.put([0, 1])
    assert_exact(h.get([0]), [0], layers=16)
    _flip_payload_byte(chunk_path(tmp_path / "kv", 1), (1 << 20) + 777)  # second block
    assert h.get([1]) == [None]
    assert h.backend.stats()["corrupt_by_reason"] == {"checksum": 1}
