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
