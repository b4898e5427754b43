"""Live vLLM-CPU runs (tiny twin) with tracing: reads ahead, async loads and a collector that is
down are each still one trace per request (the trace itself over OTLP: test_export_live.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvscope.testkit.tracing import assert_children_nest_in_parents, free_tcp_port

from kvscope import analysis
from kvscope.contract import rundir
from kvscope.capture.workload.options import RunOptions
from kvscope.capture.workload.runner import execute
from kvscope.contract import semconv

pytestmark = [pytest.mark.live]

MODELS_DIR = Path(os.environ.get("KVSCOPE_MODELS_DIR", Path.home() / ".cache/kvscope/models"))
REQUESTS = 4


def _run(tmp_path: Path, monkeypatch, env: dict[str, str], phases: list[str],
         profile: str = "stock") -> Path:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    opts = RunOptions(out=tmp_path / "run", model="tiny", models_dir=MODELS_DIR,
                      requests=REQUESTS, concurrency=[2], prompt_tokens=600, phases=phases,
                      kv_dir=tmp_path / "kv", port=free_tcp_port(), probes=False,
                      profile=profile)
    return execute(opts)


@pytest.mark.root
def test_reads_ahead_at_lookup_are_spans_of_the_request_that_claimed_them(tmp_path, monkeypatch):
    run = _run(tmp_path, monkeypatch, {}, ["warm", "cold"], profile="kvscope")
    loaded = analysis.load_run(run)
    spans = loaded.spans
    reads = spans[spans["name"] == semconv.SPAN_STORAGE_READ]
    cold_ids = set(loaded.requests.loc[loaded.requests["phase"] == "cold", "request_id"])
    assert set(reads["request_id"]) == cold_ids
    chunks = {rid: 0 for rid in cold_ids}
    for read in reads.itertuples():
        attrs = read.attributes
        assert attrs[semconv.READ_AHEAD] is True and attrs[semconv.READ_BYTES] > 0
        assert attrs[semconv.READER_TIDS] and attrs[semconv.READ_FAILED_CHUNKS] == 0
        chunks[read.request_id] += attrs[semconv.READ_CHUNKS]
    assert set(chunks.values()) == {600 // 256}, "every full chunk was read ahead and claimed"
    assert_children_nest_in_parents(spans)
    # the backend's own counters, per phase, agree with the spans
    by_phase = rundir.read_manifest(run)["disk_backend"]["by_phase"]
    assert list(by_phase) == ["warm", "cold"]
    assert by_phase["warm"]["read_hits"] == 0
    cold = by_phase["cold"]
    assert cold["read_hits"] == cold["prefetch_claimed"] == REQUESTS * (600 // 256)
    assert cold["corrupt_chunks"] == 0

    attribution = analysis.attribute(loaded)
    cold = attribution[attribution["phase"] == "cold"]
    parts = [f"{c}_ns" for c in analysis.attribution.COMPONENTS]
    assert (cold[parts].sum(axis=1) == cold["ttft_ns"]).all()
    assert (cold["storage_read_ns"] + cold["hidden_storage_read_ns"] > 0).all()


@pytest.mark.root
@pytest.mark.parametrize("profile", ["stock-async", "kvscope-async"])
def test_async_loading_reads_are_spans_of_the_request_they_were_made_for(
        tmp_path, monkeypatch, profile):
    """LMCache reads at lookup, keyed by vLLM's request id, before the worker knows the trace."""
    run = _run(tmp_path, monkeypatch, {}, ["warm", "cold"], profile=profile)
    loaded = analysis.load_run(run)
    requests, spans = loaded.requests, loaded.spans
    cold = requests[requests["phase"] == "cold"]
    assert (cold["cached_tokens"] >= 512).all(), "async loading served the cold hits"
    reads = spans[spans["name"] == semconv.SPAN_STORAGE_READ]
    assert set(reads["request_id"]) == set(cold["request_id"])
    for rid, own in reads.groupby("request_id"):
        attrs = list(own["attributes"])
        assert sum(a[semconv.READ_CHUNKS] for a in attrs) == 600 // 256, rid
        assert all(a[semconv.READ_BYTES] > 0 and a[semconv.READER_TIDS] for a in attrs), rid
    assert_children_nest_in_parents(spans)
    attribution = analysis.attribute(loaded)
    attribution = attribution[attribution["phase"] == "cold"]
    assert (attribution["storage_read_ns"] > 0).all()


def test_collector_down_serving_goes_on_and_loss_is_counted(tmp_path, monkeypatch):
    run = _run(tmp_path, monkeypatch, {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{free_tcp_port()}",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1", "OTEL_BSP_SCHEDULE_DELAY": "200"}, ["warm"])
    requests = rundir.read_table(run, "requests")
    assert (requests["status"] == "ok").all() and len(requests) == REQUESTS
    spans = analysis.load_run(run).spans
    firsts = spans[spans["name"] == semconv.SPAN_FIRST_TOKEN]
    assert sorted(firsts["request_id"]) == sorted(requests["request_id"]), "files complete"
    tracer = rundir.read_manifest(run)["tracer"]
    assert tracer["export_failures"] > 0 and tracer["failed_spans"] > 0
    assert tracer["spans_exported"]["file"] == len(spans)
