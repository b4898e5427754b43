# SPDX-License-Identifier: Apache-2.0
"""tune.choose's reasoning on a device whose behaviour is known exactly (a latency plus a
bandwidth per read, a ceiling), and `kvscope.tune: auto` in a real backend.

The real raw reader is what the backend and `kvscope tune` use (bench/read_path.py measures the
chosen knobs against a hand-set sweep); here the reader is a formula so the choice can be
checked by hand."""

# Standard
from pathlib import Path
import math

# Third Party
import pytest

# First Party
from kvscope.patched_backend.parallel_disk import tune
from kvscope.patched_backend.parallel_disk.config import from_extra_config

MIB = 1 << 20
CEILING, LATENCY, BANDWIDTH, VERIFY = 2e9, 0.002, 1e9, 8e9


def _device(files: list[Path], unit: int, depth: int) -> float:
    """Each read takes LATENCY + unit / BANDWIDTH; the device moves at most CEILING."""
    return min(CEILING, depth * unit / (LATENCY + unit / BANDWIDTH))


@pytest.mark.parametrize("chunk, unit, readers", [
    (64 * MIB, 64 * MIB, 4),  # 69 ms a read: 2.06 -> 3 in flight, + verify 8 ms -> 4 readers
    (3 * MIB, 3 * MIB, 5),  # 5.1 ms a read: 3.3 -> 4 in flight, + verify 0.4 ms -> 5 readers
])
def test_littles_law_picks_the_largest_unit_that_reaches_the_ceiling(chunk, unit, readers,
                                                                     tmp_path):
    (tmp_path / "a.kvc").write_bytes(b"")
    choice = tune.choose([tmp_path / "a.kvc"], chunk, _device, VERIFY)
    service = LATENCY + unit / BANDWIDTH
    needed = math.ceil(CEILING * service / unit)
    assert readers == math.ceil(needed * (service + unit / VERIFY) / service)
    assert (choice.read_unit, choice.queue_depth) == (unit, readers)
    assert choice.max_inflight_bytes == unit * readers
    assert choice.reasons[-1].startswith(f"chosen: {unit / MIB:g} MiB x {readers} readers")


def test_a_unit_that_falls_short_at_its_depth_is_not_chosen(tmp_path):
    def slow_large(files, unit, depth):  # 64 MiB reads never pass 1.5 GB/s on this device
        rate = _device(files, unit, depth)
        return min(rate, 1.5e9) if unit >= 64 * MIB else rate

    (tmp_path / "a.kvc").write_bytes(b"")
    choice = tune.choose([tmp_path / "a.kvc"], 64 * MIB, slow_large, VERIFY)
    assert choice.read_unit == 16 * MIB


def test_when_no_candidate_reaches_the_ceiling_the_fastest_wins(tmp_path):
    calls = []

    def behind(files, unit, depth):  # the ceiling, measured first, was a fast moment
        calls.append(unit)
        if len(calls) <= len(tune.CEILING_POINTS):
            return CEILING
        return min(0.9 * CEILING, _device(files, unit, depth))

    (tmp_path / "a.kvc").write_bytes(b"")
    choice = tune.choose([tmp_path / "a.kvc"], 64 * MIB, behind, VERIFY)
    assert choice.read_unit == 64 * MIB and "none came within 3%" in choice.reasons[-1]


def test_small_reads_that_queue_get_the_depth_where_the_rate_stops_growing(tmp_path):
    """Each read takes longer the more are in flight (the device serves only so many at once):
    Little's law on a read alone (6 readers for 3 MiB) reaches 73 % of the ceiling; the search
    doubles the depth while the rate grows (12: 92 %, 24: 100 %, 48: no gain) and stops at 24."""
    def queueing(files, unit, depth):
        return min(CEILING, depth * unit / ((LATENCY + unit / BANDWIDTH) * (1 + depth / 4)))

    (tmp_path / "a.kvc").write_bytes(b"")
    choice = tune.choose([tmp_path / "a.kvc"], 3 * MIB, queueing, VERIFY)
    assert queueing([], 3 * MIB, 6) < 0.75 * CEILING  # where Little's law alone would stop
    assert (choice.read_unit, choice.queue_depth) == (3 * MIB, 24)
    assert "3 MiB by readers (GB/s): 6 1.47, 12 1.83, 24 2.00, 48 2.00" in "\n".join(
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
