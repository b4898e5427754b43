# SPDX-License-Identifier: Apache-2.0
"""Issue 14 item 5: no file can stop the tier from starting, and none is served unchecked.

Malformed chunk files are written as real files next to a good chunk: each carries a valid
header checksum (so the scan reaches its fields) and one bad field. The tier must start,
serve the good chunk, refuse and count the bad file and move it aside. Then property tests
(hypothesis): random and mutated header blocks only ever decode or raise CorruptChunk, and
a directory of mutated chunk files never makes the scan raise; whatever it indexes is
exactly a chunk that was written, everything else is counted.
"""

import os
import shutil
import struct
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lmcache.utils import parse_cache_key

from kvscope.patched_backend.parallel_disk.chunkfile import (
    HEADER_SIZE, QUARANTINE_SUFFIX, ChunkHeader, CorruptChunk, decode_header, encode_header,
    file_name, file_size_for, read_header,
)
from kvscope.patched_backend.parallel_disk.geometry import EngineGeometry
from kvscope.patched_backend.parallel_disk.recovery import scan
from kvscope.testkit.lmcache_harness import CHUNK, assert_exact, chunk_path, key, metadata


def _plant(directory: Path, template: Path, name: str = "", **fields) -> Path:
    """A copy of ``template`` whose header has ``fields`` changed (header checksum valid)."""
    header, _ = read_header(str(template))
    bad = replace(header, **fields)
    target = directory / (name or file_name(bad.key))
    with open(template, "rb") as f:
        payload = f.read()[HEADER_SIZE:]
    target.write_bytes(encode_header(bad) + payload)
    os.chmod(target, 0o600)
    return target


OTHER = key(99).to_string()
BAD_HEADERS = [
    pytest.param({"key": OTHER, "dtype": "torch.nonsense"}, "corrupt_header", id="dtype"),
    pytest.param({"key": OTHER, "shape": ("a", 2)}, "corrupt_header", id="shape-type"),
    pytest.param({"key": OTHER, "shape": (2, 4, CHUNK, 64)}, "corrupt_header",
                 id="shape-size-disagrees"),
    pytest.param({"key": OTHER, "fmt": "NOPE"}, "corrupt_header", id="fmt"),
    pytest.param({"key": OTHER, "cached_positions": ["x"]}, "corrupt_header", id="positions"),
    pytest.param({"key": "kvscope-test-model@1@0@zz@bfloat16"}, "corrupt_header",
                 id="key-syntax"),
    pytest.param({"key": "kvscope-test-model@1@0@01063@bfloat16"}, "corrupt_header",
                 id="key-not-canonical"),
    pytest.param({"key": OTHER, "geometry": ["not", "a", "dict"]}, "corrupt_header",
                 id="geometry-type"),
]


@pytest.mark.parametrize(("fields", "reason"), BAD_HEADERS)
def test_malformed_header_is_quarantined_and_the_tier_starts(harness, tmp_path, fields, reason):
    kv = tmp_path / "kv"
    first = harness()
    first.put([0, 1])
    first.close()
    bad = _plant(kv, Path(chunk_path(kv, 1)), **fields)
    if bad != Path(chunk_path(kv, 1)):
        os.unlink(chunk_path(kv, 1))
    second = harness()  # must start (the plugin loaded) whatever the file says
    stats = second.backend.stats()
    assert stats["corrupt_by_reason"] == {reason: 1}, stats
    assert stats["chunks"] == 1
    assert not bad.exists() and Path(str(bad) + QUARANTINE_SUFFIX).exists()
    assert_exact(second.get([0]), [0])
    assert second.get([1]) == [None] and second.get([99]) == [None]


def test_chunk_under_another_name_is_refused_not_double_counted(harness, tmp_path):
    kv = tmp_path / "kv"
    first = harness()
    first.put([0])
    first.close()
    copy = kv / ("0" * 40 + ".kvc")
    shutil.copy(chunk_path(kv, 0), copy)
    os.chmod(copy, 0o600)
    second = harness()
    stats = second.backend.stats()
    assert stats["corrupt_by_reason"] == {"misnamed": 1}
    assert stats["chunks"] == 1 and stats["used_bytes"] == os.path.getsize(chunk_path(kv, 0))
    assert_exact(second.get([0]), [0])


def test_json_that_is_not_an_object_is_refused(harness, tmp_path):
    """Metadata ``[]`` with a valid header checksum: a TypeError inside the parser."""
    kv = tmp_path / "kv"
    first = harness()
    first.put([0])
    first.close()
    meta = b"[]"
    head = struct.pack("<8sIIQII", b"KVSCOPE\x01", 3, len(meta), 4096, 1 << 20, 0)
    block = head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head + meta)) + meta
    planted = kv / ("1" * 40 + ".kvc")
    planted.write_bytes(block.ljust(HEADER_SIZE, b"\0") + b"\0" * 4096)
    second = harness()
    assert second.backend.stats()["corrupt_by_reason"] == {"corrupt_header": 1}
    assert_exact(second.get([0]), [0])


# -- properties -------------------------------------------------------------------------------

def _valid_block() -> bytes:
    shape = (2, 4, CHUNK, 128)
    header = ChunkHeader(key=key(5).to_string(), shape=shape, dtype="torch.bfloat16",
                         fmt="KV_2LTD", payload_len=2 * 4 * CHUNK * 128 * 2, hash_block=1 << 20,
                         hashes=(123,), cached_positions=list(range(8)),
                         geometry={"num_layers": 4}, layout={"writer": "lmcache-kv2ltd"})
    return encode_header(header)


VALID = _valid_block()
VALID_SIZE = file_size_for(2 * 4 * CHUNK * 128 * 2)


def _decodes_or_refuses(block: bytes, size: int) -> None:
    try:
        header = decode_header(block, size)
    except CorruptChunk as exc:
        assert exc.reason in ("truncated", "foreign", "format_version", "corrupt_header")
        return
    assert decode_header(encode_header(header), size) == header  # what decodes, re-encodes


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=HEADER_SIZE), st.integers(0, 1 << 40))
def test_random_header_blocks_decode_or_raise_corrupt_chunk(block, size):
    _decodes_or_refuses(block, size)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 600), st.integers(0, 255)), min_size=1, max_size=8),
       st.sampled_from([VALID_SIZE, VALID_SIZE - 4096, 4096]))
def test_mutated_header_blocks_decode_or_raise_corrupt_chunk(flips, size):
    block = bytearray(VALID)
    for offset, value in flips:
        block[offset] = value
    _decodes_or_refuses(bytes(block), size)


FILE_DAMAGE = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, HEADER_SIZE + 8191), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, HEADER_SIZE + 8191), st.just(0)),
    st.tuples(st.just("rename"), st.just(0), st.just(0)),
    st.tuples(st.just("none"), st.just(0), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(FILE_DAMAGE, min_size=1, max_size=6))
def test_scan_of_damaged_files_never_raises_and_counts_every_file(damages):
    geometry = EngineGeometry.from_metadata(metadata())
    with tempfile.TemporaryDirectory() as directory:
        written = {}
        for i, (kind, offset, value) in enumerate(damages):
            text = key(i).to_string()
            header = ChunkHeader(key=text, shape=(2, 1, 16, 128), dtype="torch.bfloat16",
                                 fmt="KV_2LTD", payload_len=8192, hash_block=1 << 20,
                                 hashes=(7,), geometry={}, layout=geometry.layout)
            path = Path(directory) / file_name(text)
            path.write_bytes(encode_header(header) + b"\1" * 8192)
            written[text] = header
            if kind == "flip":
                data = bytearray(path.read_bytes())
                data[offset] ^= value
                path.write_bytes(bytes(data))
            elif kind == "truncate":
                os.truncate(path, offset)
            elif kind == "rename":
                path.rename(Path(directory) / file_name(key(1000 + i).to_string()))
        result = scan(directory, geometry.owns, lambda h: None, parse_cache_key)
        assert len(result.chunks) + len(result.refused) + result.not_ours == len(damages)
        for found in result.chunks:  # indexed only as written, under its own name
            assert found.header == written[found.header.key]
            assert os.path.basename(found.path) == file_name(found.header.key)
