# SPDX-License-Identifier: Apache-2.0
"""tune.choose's reasoning on a device whose behaviour is known exactly (a latency plus a
bandwidth per read, a ceiling, readers that verify what they read), the serving-path reader it
measures candidates with on real chunk files, and `kvscope.tune: auto` in a real backend.

The choice on a real disk is tests/kvscope/test_tune_cli.py's (bench/read_path.py measures the
chosen knobs against a hand-set sweep); here the readers are formulas so the choice can be
checked by hand."""

# Standard
from pathlib import Path
import math

# Third Party
import pytest

# First Party
from kvscope.patched_backend.parallel_disk import tune
from kvscope.patched_backend.parallel_disk.chunkfile import HEADER_SIZE
from kvscope.patched_backend.parallel_disk.config import from_extra_config
from kvscope.testkit.chunk_files import write_chunks

MIB = 1 << 20
CEILING, LATENCY, BANDWIDTH, VERIFY = 2e9, 0.002, 1e9, 8e9


def _device(files: list[Path], unit: int, depth: int) -> float:
    """Each read takes LATENCY + unit / BANDWIDTH; the device moves at most CEILING."""
    return min(CEILING, depth * unit / (LATENCY + unit / BANDWIDTH))


def _queueing(files: list[Path], unit: int, depth: int) -> float:
    """A device that serves only so many reads at once: each read takes longer the more are in
    flight."""
    return min(CEILING, depth * unit / ((LATENCY + unit / BANDWIDTH) * (1 + depth / 4)))


def _path(files: list[Path], unit: int, depth: int) -> float:
    """The serving path on that device: each reader also verifies a unit before its next read."""
    return min(CEILING, depth * unit / (LATENCY + unit / BANDWIDTH + unit / VERIFY))


@pytest.mark.parametrize("chunk, unit, readers", [
    (64 * MIB, 64 * MIB, 3),  # 69 ms a read + 8 ms to verify: 2 GB/s x 78 ms = 2.3 units -> 3
    (3 * MIB, 3 * MIB, 4),  # 5.1 ms a read + 0.4 ms to verify: 3.5 units -> 4 readers
])
def test_littles_law_picks_the_largest_unit_that_reaches_the_ceiling(chunk, unit, readers,
                                                                     tmp_path):
    (tmp_path / "a.kvc").write_bytes(b"")
    choice = tune.choose([tmp_path / "a.kvc"], chunk, _device, _path)
    cycle = LATENCY + unit / BANDWIDTH + unit / VERIFY
    assert readers == math.ceil(CEILING * cycle / unit)
    assert (choice.read_unit, choice.queue_depth) == (unit, readers)
    assert choice.max_inflight_bytes == unit * readers
    assert choice.reasons[-1].startswith(f"chosen: {unit / MIB:g} MiB x {readers} readers")


def test_a_unit_that_falls_short_at_its_depth_is_not_chosen(tmp_path):
    def slow_large(files, unit, depth):  # 64 MiB reads never pass 1.5 GB/s on this device
        rate = _path(files, unit, depth)
        return min(rate, 1.5e9) if unit >= 64 * MIB else rate

    (tmp_path / "a.kvc").write_bytes(b"")
    choice = tune.choose([tmp_path / "a.kvc"], 64 * MIB, _device, slow_large)
    assert choice.read_unit == 16 * MIB


def test_a_machine_that_drifts_while_measured_widens_what_counts_as_equal(tmp_path):
    """64 MiB reads come 8 % short of 16 MiB ones: on a steady machine 16 MiB wins; when the
    ceiling read again after the candidates moved 15 %, 8 % is within the noise and the larger
    unit's fewer reads win."""
    def short_large(files, unit, depth):
        return _path(files, unit, depth) * (0.92 if unit >= 64 * MIB else 1.0)

    calls = []

    def drifting(files, unit, depth):  # the last call is the ceiling read again
        calls.append(unit)
        return _device(files, unit, depth) * (0.85 if len(calls) > len(tune.CEILING_POINTS)
                                              else 1.0)

    (tmp_path / "a.kvc").write_bytes(b"")
    assert tune.choose([tmp_path / "a.kvc"], 64 * MIB, _device, short_large).read_unit == 16 * MIB
    choice = tune.choose([tmp_path / "a.kvc"], 64 * MIB, drifting, short_large)
    assert choice.read_unit == 64 * MIB
    assert "ceiling again, 4 MiB x 32: 1.70 GB/s, 15% from the first" in choice.reasons
    assert "within 15% of the best rate" in choice.reasons[-1]


def test_when_no_candidate_reaches_the_ceiling_the_fastest_wins(tmp_path):
    def behind(files, unit, depth):  # verifying readers on two cores: 0.9 of the raw ceiling
        return min(0.9 * CEILING, _path(files, unit, depth))

    (tmp_path / "a.kvc").write_bytes(b"")
    choice = tune.choose([tmp_path / "a.kvc"], 64 * MIB, _device, behind)
    assert choice.read_unit == 64 * MIB and "none came within 3%" in choice.reasons[-1]


def test_small_reads_that_queue_get_the_depth_where_the_rate_stops_growing(tmp_path):
    """Each read takes longer the more are in flight (the device serves only so many at once):
    Little's law on a reader alone (5 readers for 3 MiB) reaches 68 % of the ceiling; the search
    doubles the depth while the rate grows (10: 87 %, 20: 100 %, 40 and 64: no gain) and keeps
    20."""
    (tmp_path / "a.kvc").write_bytes(b"")
    choice = tune.choose([tmp_path / "a.kvc"], 3 * MIB, _device, _queueing)
    assert _queueing([], 3 * MIB, 5) < 0.7 * CEILING  # where Little's law alone would stop
    assert (choice.read_unit, choice.queue_depth) == (3 * MIB, 20)
    assert ("3 MiB by readers (GB/s): 5 1.36, 10 1.75, 20 2.00, 40 2.00, 64 2.00; 20 readers"
            in "\n".join(choice.reasons))


def test_the_path_reader_reads_through_the_engine_and_its_checksums(tmp_path):
    """What a candidate is measured with is the serving path: a payload byte flipped on disk
    fails the measurement with checksums on (the backend then keeps the knobs as set), and reads
    through with them off (``verify_checksum: false`` is tuned without the checksum's cost)."""
    files = write_chunks(tmp_path, 4, (MIB,))
    assert tune.PathReader()(files, MIB, 2) > 0
    with open(files[2], "r+b") as f:
        f.seek(HEADER_SIZE + MIB + 5)
        byte = f.read(1)
        f.seek(HEADER_SIZE + MIB + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(OSError, match=f"{files[2].name}: checksum"):
        tune.PathReader()(files, MIB, 2)
    assert tune.PathReader(verify=False)(files, MIB, 2) > 0


def test_chunk_files_skips_what_would_not_be_served(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "MIN_BYTES", 4 * MIB)
    files = write_chunks(tmp_path, 3, (MIB,))
    (tmp_path / "junk.kvc").write_bytes(b"\0" * (8 * MIB))  # largest, not a chunk
    chosen, chunk_bytes = tune.chunk_files(tmp_path)
    assert sorted(chosen) == sorted(files) and chunk_bytes == 2 * MIB
    files[0].unlink()
    files[1].unlink()
    assert tune.chunk_files(tmp_path) == ([], 0)  # 2 MiB of real chunks left: under MIN_BYTES


def test_one_slow_moment_does_not_end_the_depth_search(tmp_path):
    """The measurement at 10 readers lands in a slow moment (another process took the cores):
    the search looks one doubling further before it gives up, and finds 20."""
    def dip(files, unit, depth):
        return _queueing(files, unit, depth) * (0.7 if depth == 10 else 1.0)

    (tmp_path / "a.kvc").write_bytes(b"")
    choice = tune.choose([tmp_path / "a.kvc"], 3 * MIB, _device, dip)
    assert (choice.read_unit, choice.queue_depth) == (3 * MIB, 20)
    assert "3 MiB by readers (GB/s): 5 1.36, 10 1.22, 20 2.00, 40 2.00, 64 2.00" in "\n".join(
        choice.reasons)


def test_a_measurement_that_fails_leaves_the_knobs_as_set(harness, monkeypatch, tmp_path, capfd):
    gone = tmp_path / "gone.kvc"  # listed, then removed before it was read
    monkeypatch.setattr(tune, "chunk_files", lambda directory: ([gone], 64 * MIB))
    h = harness(**{"kvscope.tune": "auto", "kvscope.queue_depth": 7})
    assert h.backend.stats()["queue_depth"] == 7
    assert "tune auto could not measure" in capfd.readouterr().err  # LMCache's own handler


def test_auto_with_too_few_chunks_keeps_the_knobs_and_serial_refuses_it(harness):
    h = harness(**{"kvscope.tune": "auto", "kvscope.queue_depth": 7})
    assert h.backend.stats()["queue_depth"] == 7  # nothing on disk to measure
    with pytest.raises(ValueError, match="kvscope.tune: serial mode"):
        from_extra_config({"kvscope.path": "/x", "kvscope.capacity": "1GB",
                           "kvscope.mode": "serial", "kvscope.prefetch_on_lookup": False,
                           "kvscope.pipeline_transfer": False, "kvscope.tune": "auto"})
