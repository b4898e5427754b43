"""What-if model arithmetic and the findings rules."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from kvscope.analysis import attribute, summarize, whatif
from kvscope.testkit.memory_runs import memory_run


def test_model_is_bandwidth_bound_until_the_queue_is_too_shallow():
    x = whatif.Inputs(kv_bytes_per_token=262_144, context_tokens=8192, hit_tokens=8192,
                      concurrency=16, read_bw=5.23e9, prefill_tokens_per_s=1e4,
                      queue_depth=64, chunk_bytes=64 << 20, read_latency_s=0.05)
    deep = whatif.predict(x)
    assert deep["storage_s"] == pytest.approx(16 * 8192 * 262_144 / 5.23e9)
    shallow = whatif.scale(x, queue_depth=1)
    assert shallow["effective_bw"] == pytest.approx((64 << 20) / 0.05)
    assert shallow["ttft_s"] > deep["ttft_s"]


def test_published_table_states_fits_predictions_and_inconsistency():
    table = whatif.published_table()
    assert set(table["kind"]) >= {"fitted", "predicted", "check"}
    fit = table[table["kind"] == "fitted"].iloc[0]
    assert fit["model"] == pytest.approx(37.97)
    high = table[table["case"].str.startswith("high end")].iloc[0]
    assert high["model"] == pytest.approx(26.35, rel=0.01)
    assert table["error"].str.contains("inconsistent").any()


def _storage_heavy(depth: int, with_io: bool):
    attrs = {"kvscope.storage.reader_tids": [7]}
    run = memory_run([{"request_id": "r", "arrival_ns": 0, "first_token_ns": 100_000_000,
                       "cached_tokens": 100}], [
        {"request_id": "r", "name": "kvscope.queue", "start_ns": 0, "end_ns": 5_000_000},
        {"request_id": "r", "name": "kvscope.storage.read", "start_ns": 5_000_000,
         "end_ns": 90_000_000, "attributes": attrs, "trace_id": "a" * 32},
        {"request_id": "r", "name": "kvscope.prefill", "start_ns": 90_000_000,
         "end_ns": 100_000_000}],
        block_io=[{"tid": 7, "start_ns": 5_000_000, "issue_ns": 6_000_000,
                   "complete_ns": 89_000_000}] if with_io else None)
    run.queue_depth = pd.DataFrame({"phase": "cold", "ts_ns": [0, 100_000_000], "device": "vda",
                                    "hw_queue": -1, "inflight": [depth, 0], "source": "bpf"})
    return run


@pytest.mark.parametrize(("depth", "with_io", "finding"), [
    pytest.param(8, True, "device-saturated", id="deep-queue-device-time"),
    pytest.param(1, False, "software-bound", id="shallow-queue-no-device-time"),
])
def test_storage_findings_say_why(depth, with_io, finding):
    run = _storage_heavy(depth, with_io)
    summary = summarize(run, attribute(run))
    assert finding in {f["id"] for f in summary["findings"]}


@pytest.mark.parametrize(("ceiling_bytes_per_s", "finding", "words"), [
    pytest.param(13e6, "device-saturated", "of the 0.01 GB/s device ceiling",
                 id="reads-at-the-measured-ceiling"),
    pytest.param(1e12, "storage-bound", "0% of the 1000.00 GB/s device ceiling",
                 id="reads-far-below-the-measured-ceiling"),
    pytest.param(1e6, "ceiling-under-measured", "the ceiling was under-measured by at least",
                 id="reads-faster-than-the-ceiling"),
])
def test_measured_ceiling_decides_saturation(ceiling_bytes_per_s, finding, words):
    run = _storage_heavy(8, True)
    run.block_io = run.block_io.assign(bytes=1 << 20)  # 1 MiB in 84 ms: about 12.5 MB/s
    run.manifest["device_ceiling"] = {"bytes_per_s": ceiling_bytes_per_s}
    summary = summarize(run, attribute(run))
    found = {f["id"]: f["message"] for f in summary["findings"]}
    assert finding in found, found
    assert words in found[finding]
    assert "the disk was busy 100% of the phase's read span" in found[finding]
    percents = [int(p) for p in re.findall(r"(\d+)%", found[finding])]
    assert max(percents) <= 100 or finding == "ceiling-under-measured"
    assert "device-saturated" not in found or finding == "device-saturated"


def test_a_stray_read_of_another_thread_leaves_the_busy_share_of_the_read_paths_reads():
    """One read by a thread that is no reader, 3 s after the read path's: the finding still says
    the disk was busy all of the read path's span (counting it too would say 3 %)."""
    run = _storage_heavy(8, True)
    stray = {"tid": 99, "start_ns": 3_000_000_000, "issue_ns": 3_000_000_000,
             "complete_ns": 3_001_000_000}
    run.block_io = pd.concat([run.block_io, run.block_io.assign(**stray)], ignore_index=True)
    found = {f["id"]: f["message"] for f in summarize(run, attribute(run))["findings"]}
    assert "the disk was busy 100% of the phase's read span" in found["device-saturated"]


def test_a_study_ceiling_overrides_the_runs_own():
    run = _storage_heavy(8, True)
    run.block_io = run.block_io.assign(bytes=1 << 20)
    run.manifest["device_ceiling"] = {"bytes_per_s": 1e6}  # this run's own, under-measured
    run.manifest["study"] = {"device_ceiling": {"bytes_per_s": 13e6, "samples": [{}, {}, {}]}}
    found = {f["id"]: f["message"] for f in summarize(run, attribute(run))["findings"]}
    assert "ceiling-under-measured" not in found
    assert "(best of 3 measurements)" in found["device-saturated"]


def test_disk_backend_counters_give_refusal_and_read_ahead_findings_per_phase():
    run = _storage_heavy(8, True)
    counters = {"corrupt_chunks": 0, "corrupt_by_reason": {}, "prefetch_reads": 16,
                "prefetch_unclaimed": 0}
    run.manifest["tracer"] = {"disk_backend_by_phase": {
        "warm": counters,
        "cold-c1": {**counters, "corrupt_chunks": 2, "corrupt_by_reason": {"checksum": 2},
                    "prefetch_reads": 40, "prefetch_unclaimed": 3},
        "cold-c8": {**counters, "corrupt_chunks": 2, "corrupt_by_reason": {"checksum": 2},
                    "prefetch_reads": 72, "prefetch_unclaimed": 3},
    }}
    found = [(f["id"], f["message"]) for f in summarize(run, attribute(run))["findings"]
             if f["id"] in ("refused-chunks", "unclaimed-read-ahead")]
    assert [(i, m.split(":")[0]) for i, m in found] == [("refused-chunks", "cold-c1"),
                                                         ("unclaimed-read-ahead", "cold-c1")]
    assert "refused 2 chunk files (2 checksum)" in found[0][1]
    assert "3 chunks read ahead at lookup (of 24 started)" in found[1][1]


def test_slowdown_moves_the_measured_ttft_by_the_predicted_change_of_storage():
    x = whatif.Inputs(kv_bytes_per_token=1024, context_tokens=3840, hit_tokens=3584,
                      concurrency=1, read_bw=0.6e9, prefill_tokens_per_s=1e4, fixed_s=0.05)
    storage = 3584 * 1024 / 0.6e9
    measured = 0.1  # the run's median TTFT: more than the model's 0.05 + prefill + storage
    slower = whatif.slowdown(x, measured, read_bw=0.15e9)
    assert slower["storage"] == pytest.approx(4.0)
    assert slower["ttft"] == pytest.approx((measured + 3 * storage) / measured)
    # the same from the serial path's shape: one 128 KiB read in flight, 1 ms each
    depth_one = whatif.slowdown(x, measured, queue_depth=1, chunk_bytes=128 << 10,
                                read_latency_s=1e-3)
    assert depth_one["storage"] == pytest.approx(0.6e9 / ((128 << 10) / 1e-3))


def _attribution(storage_ms: list[float], other_ms: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A cold run's attribution and requests at concurrency 1: every request hits 14 chunks of
    the tiny twin (256 KiB each) and spends `other_ms` outside the read, 1/5 of it prefilling."""
    n = len(storage_ms)
    storage = pd.Series(storage_ms) * 1e6
    attribution = pd.DataFrame({
        "request_id": [f"r{i}" for i in range(n)], "phase": "cold", "concurrency": 1,
        "partial": False, "read_bytes": 14 * (256 << 10),
        "storage_read_ns": storage.astype("int64"),
        "prefill_ns": int(other_ms * 2e5), "ttft_ns": (storage + other_ms * 1e6).astype("int64")})
    requests = pd.DataFrame({"request_id": attribution["request_id"], "prompt_tokens": 3840,
                             "cached_tokens": 3584})
    return attribution, requests


def test_a_parallel_runs_fit_given_the_serial_bandwidth_predicts_the_measured_slowdown():
    fast, fast_requests = _attribution([6.0, 6.5, 5.5, 6.2, 5.8], other_ms=40)
    slow, slow_requests = _attribution([24.0, 25.0, 23.5, 24.5, 24.2], other_ms=40)
    fast_fit, _ = whatif.fit_run(fast, fast_requests, 1024)
    slow_fit, _ = whatif.fit_run(slow, slow_requests, 1024)
    predicted = whatif.slowdown(fast_fit, whatif.medians(fast)["ttft"], read_bw=slow_fit.read_bw)
    measured = whatif.measured_slowdown(slow, fast)
    assert measured["ttft"] == pytest.approx((24.2 + 40) / (6.0 + 40))
    assert measured["storage"] == pytest.approx(24.2 / 6.0)
    for part in ("ttft", "storage"):
        assert predicted[part] == pytest.approx(measured[part], rel=0.02), part


def test_a_slowdown_of_runs_without_complete_requests_is_refused():
    fast, _ = _attribution([6.0], other_ms=40)
    with pytest.raises(ValueError, match="no complete requests"):
        whatif.measured_slowdown(fast.assign(partial=True), fast)


def test_a_few_stalled_requests_do_not_set_the_fitted_read_bandwidth():
    steady, requests = _attribution([30.0, 31.0, 29.0, 28.0, 32.0], other_ms=40)
    stalled, _ = _attribution([30.0, 29.0, 28.0, 140.0, 120.0], other_ms=40)
    fits = [whatif.fit_run(frame, requests, 1024)[0] for frame in (steady, stalled)]
    assert fits[1].read_bw == pytest.approx(fits[0].read_bw)
    assert fits[0].read_bw == pytest.approx(14 * (256 << 10) / 0.030)
