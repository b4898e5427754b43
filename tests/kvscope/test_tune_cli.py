"""`kvscope tune` as a user runs it: the command line on a real directory of chunk files, real
O_DIRECT reads through the serving path, no vLLM. The choice is whatever this disk gives (a
timing is never asserted); what must hold is that it is a configuration the backend accepts,
within the search's bounds, and that the printed reasoning is the measurement it came from:
a depth one unit's search read, read again in the finals."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.patched_backend.parallel_disk import tune
from kvscope.patched_backend.parallel_disk.chunkfile import HEADER_SIZE
from kvscope.patched_backend.parallel_disk.config import from_extra_config
from kvscope.testkit.chunk_files import write_chunks, write_hollow_chunk

KVSCOPE = [sys.executable, "-m", "kvscope.cli", "tune", "--kv-dir"]
MIB = 1 << 20
SHAPE = (2, 24, 256, 128)  # Qwen2.5-0.5B-like KV_2LTD geometry, bf16: 3 MiB a chunk
COUNT = 86  # 258 MiB: just over tune.MIN_BYTES, so the test reads little
# An address space far below what a 6 GiB buffer needs and far above what refusing needs.
SMALL_ADDRESS_SPACE = 1 << 30
SIX_GIB_SHAPE = (2, 24, 65536, 1024)  # bf16


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("kv")
    write_chunks(directory, COUNT, SHAPE)
    return directory


def test_tune_prints_its_reasoning_and_knobs_the_backend_accepts(kv_dir):
    done = subprocess.run([*KVSCOPE, str(kv_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith(f"kvscope tune: {COUNT} chunk files of 3 MiB in {kv_dir}")
    knobs = dict(re.findall(r"^  kvscope\.(\w+): (\d+)$", out, re.M))
    unit, depth, inflight = (int(knobs[k]) for k in
                             ("read_unit", "queue_depth", "max_inflight_bytes"))
    assert unit in (MIB, 3 * MIB)  # the candidates: 1 MiB, and units capped at one chunk
    assert 2 <= depth <= tune.MAX_READERS and inflight == unit * depth
    settings = from_extra_config({"kvscope.path": str(kv_dir), "kvscope.capacity": "1GB",
                                  **{f"kvscope.{k}": v for k, v in knobs.items()}})
    assert (settings.read_unit, settings.queue_depth) == (unit, depth)
    # the reasoning: the ceiling, each candidate alone and by depth, the finals, the choice
    assert re.search(r"^  ceiling \(raw reader\): 4 MiB x 32 [\d.]+ GB/s, 16 MiB x 8 ", out, re.M)
    for candidate in ("1", "3"):
        assert re.search(rf"^  {candidate} MiB: one reader alone reads and verifies one in ",
                         out, re.M)
    steps = re.search(rf"^  {unit // MIB} MiB by readers \(GB/s\): (.*); (\d+) readers", out,
                      re.M)
    assert steps and f" {depth} " in f" {steps[1]}"  # a depth its own search read
    finals = re.search(r"^  finals, (\d+) rounds read in turn, .*: (.*)$", out, re.M)
    assert finals and int(finals[1]) == tune.FINAL_ROUNDS
    assert f"{unit // MIB} MiB x {depth} " in finals[2]  # read again in the finals
    assert f"{unit // MIB} MiB x {steps[2]} " in finals[2]  # beside the depth the search kept
    assert re.search(rf"^  chosen: {unit // MIB} MiB x {depth} readers, "
                     rf"{unit * depth // MIB} MiB in flight", out, re.M)


def test_too_few_chunks_is_one_line_naming_the_directory_and_the_fix(tmp_path):
    write_chunks(tmp_path, 2, SHAPE)
    done = subprocess.run([*KVSCOPE, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and str(tmp_path) in done.stderr
    assert "kvscope run --phases warm --keep-kv --kv-dir" in done.stderr


def _tune_in_small_memory(kv_dir: Path) -> subprocess.CompletedProcess:
    """`kvscope tune` whose address space cannot hold a buffer of a large chunk: had it
    allocated what a header claims, it would have ended in a MemoryError, not in a line."""
    return subprocess.run(["prlimit", f"--as={SMALL_ADDRESS_SPACE}", *KVSCOPE, str(kv_dir)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("make", "found"), [
    pytest.param(lambda d, as_nobody: as_nobody("mkdir", "-m", "700", str(d)),
                 "is owned by uid 65534", id="another-users"),
    pytest.param(lambda d, as_nobody: (d.mkdir(), d.chmod(0o777)),
                 "has mode 0777 (group/world-writable)", id="world-writable"),
])
def test_a_kv_directory_the_backend_would_refuse_is_refused_in_one_line(
        shared_tmp, as_nobody, make, found):
    """Before: tune read any directory, another user's or a world-writable one, whose files
    that user could have planted or swapped while a root tune read them."""
    kv_dir = shared_tmp / "kv"
    make(kv_dir, as_nobody)
    done = subprocess.run([*KVSCOPE, str(kv_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"kvscope tune: --kv-dir {kv_dir} {found}")
    assert list(shared_tmp.iterdir()) == [kv_dir] and list(kv_dir.iterdir()) == []


def test_a_chunk_whose_header_claims_6_gib_is_refused_by_name_without_allocating(tmp_path):
    """Before: a sparse file whose real header claimed a 6 GiB payload was measured: tune
    allocated and touched a 6 GiB buffer for it."""
    huge = write_hollow_chunk(tmp_path, SIX_GIB_SHAPE)
    payload_len = huge.stat().st_size - HEADER_SIZE
    assert payload_len == 6 << 30 and huge.stat().st_blocks * 512 <= 2 * HEADER_SIZE
    done = _tune_in_small_memory(tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"kvscope tune: {huge}: its header claims a payload of {payload_len} "
                           f"bytes, over the {tune.MAX_CHUNK_BYTES >> 20} MiB a chunk may hold; "
                           "nothing was read: move it out of the directory\n")
