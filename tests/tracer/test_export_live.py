"""Live (tiny twin, vLLM-CPU + LMCache): every span of every process reaches a real OTLP/gRPC
collector or its loss is counted exactly; no kvscope failure changes what a request returns."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from kvscope.testkit.tracing import assert_children_nest_in_parents, free_tcp_port, wait_until
from kvscope.testkit.user_server import complete, tiny_prompts, tokens_and_logprobs, user_server

from kvscope.contract.env import ENV_CLOCK_OFFSET, ENV_SPANS_DIR
from kvscope import analysis
from kvscope.contract import rundir, semconv
from kvscope.capture.workload.options import RunOptions
from kvscope.capture.workload.runner import execute
from kvscope.tracer import failsafe, pipeline, runtime, version
from kvscope.tracer.run import read_stats

pytestmark = [pytest.mark.live]

MODELS_DIR = Path(os.environ.get("KVSCOPE_MODELS_DIR", Path.home() / ".cache/kvscope/models"))
EVERY_REQUEST = {semconv.SPAN_CLIENT_REQUEST, semconv.SPAN_QUEUE, semconv.SPAN_KV_LOOKUP,
                 semconv.SPAN_PREFILL, semconv.SPAN_FIRST_TOKEN}
COLD_LOAD = {semconv.SPAN_KV_LOAD, semconv.SPAN_STORAGE_READ, semconv.SPAN_KV_TRANSFER}
TRACEPARENT = "00-{:032x}-00f067aa0ba902b7-01"
BAD_VALUES = {"OTEL_BSP_MAX_QUEUE_SIZE": "lots", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
              ENV_CLOCK_OFFSET: "abc"}


@pytest.mark.root
def test_kvscope_run_with_otlp_every_span_of_every_process_arrives_or_is_counted_one_trace_each(
        tmp_path, monkeypatch, otlp_receiver):
    receiver, endpoint = otlp_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    monkeypatch.delenv("OTEL_BSP_SCHEDULE_DELAY", raising=False)  # the default: 200 ms
    run = execute(RunOptions(out=tmp_path / "run", model="tiny", models_dir=MODELS_DIR,
                             requests=4, concurrency=[2], prompt_tokens=600,
                             phases=["warm", "cold"], kv_dir=tmp_path / "kv",
                             port=free_tcp_port(), probes=False))
    tracer = rundir.read_manifest(run)["tracer"]
    assert tracer["exporters"] == ["file", "otlp"]
    ended = tracer["spans_ended"]
    for name, counts in tracer["by_exporter"].items():
        assert counts["pending"] == 0, (name, counts)
        assert ended == counts["exported"] + counts["failed"] + counts["dropped"] \
            + counts["lost"], (name, counts, ended)
    otlp = tracer["by_exporter"]["otlp"]
    file_ids = _span_ids_in_files(run / rundir.SPANS_DIR)
    assert len(file_ids) == tracer["by_exporter"]["file"]["exported"]
    ours = _ours(receiver)
    received = set(ours)
    assert len(received) == otlp["exported"], (
        "the collector got what was counted exported", sorted(ours.values()),
        [(s["pid"], s["spans_ended"], s["closed"], s["by_exporter"])
         for s in read_stats(run / rundir.SPANS_DIR)])
    # so the shortfall at the collector, ended - exported, is exactly failed + dropped + lost
    # on a healthy local collector nothing is missing at all: server spans, last phase's too
    assert received == file_ids and otlp["lost"] == otlp["dropped"] == otlp["failed"] == 0
    server_pids = {s["pid"] for s in read_stats(run / rundir.SPANS_DIR)
                   if s["spans_ended"] and s["pid"] != os.getpid()}
    assert len(server_pids) >= 2, "engine core and worker exported"
    assert tracer["hook_errors"] == {} and tracer["config_errors"] == {}
    _assert_one_nested_trace_per_request(run)


def _assert_one_nested_trace_per_request(run: Path) -> None:
    """Every request's spans, from the client and both server processes, are one trace in
    which each child lies inside its parent; cold requests read, and their TTFT splits exactly."""
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


def _ours(receiver) -> dict[str, tuple[int, str]]:
    """span id -> (pid, service) of the spans kvscope's tracers sent (others may send too)."""
    out = {}
    for request in receiver.requests:
        for rs in request.resource_spans:
            attributes = {a.key: a.value for a in rs.resource.attributes}
            where = (attributes["process.pid"].int_value if "process.pid" in attributes else -1,
                     attributes["service.name"].string_value)
            for ss in rs.scope_spans:
                if ss.scope.name == version.SCOPE:
                    out.update((span.span_id.hex(), where) for span in ss.spans)
    return out


def _span_ids_in_files(spans_dir: Path) -> set[str]:
    ids = set()
    for path in spans_dir.glob("*.json"):
        for rs in json.loads(path.read_text()).get("resourceSpans", ()):
            for ss in rs.get("scopeSpans", ()):
                ids.update(span["spanId"] for span in ss.get("spans", ()))
    return ids


def _answers(server, prompts: list[list[int]]) -> list[tuple]:
    """Each prompt twice (the second loads its KV from LMCache), with a traceparent: the
    requests that crashed vLLM's engine core before kvscope failed closed."""
    out = []
    for i, prompt in enumerate(prompts + prompts):
        response = complete(server, prompt, headers={"traceparent": TRACEPARENT.format(i + 1)})
        out.append(tokens_and_logprobs(response))
    return out


def _lines_per_pid(log: str, needle: str) -> dict[int, int]:
    """pid -> number of kvscope warning lines containing `needle`."""
    pids: dict[int, int] = {}
    for match in re.finditer(r"kvscope tracer \(pid (\d+)\): (.*)", log):
        if needle in match.group(2):
            pids[int(match.group(1))] = pids.get(int(match.group(1)), 0) + 1
    return pids


@pytest.fixture(scope="module")
def answers_with_tracing_off(tmp_path_factory) -> tuple[list[list[int]], list[tuple]]:
    """The prompts and what the same server returns for them with tracing off."""
    prompts = tiny_prompts(3)
    with user_server(tmp_path_factory.mktemp("tracing-off")) as server:
        expected = _answers(server, prompts)
    assert len(expected) == 6 and all(tokens for tokens, _ in expected)
    return prompts, expected


@pytest.mark.root
def test_bad_values_each_fall_back_one_line_per_process_counted_answers_unchanged(
        tmp_path, otlp_receiver, answers_with_tracing_off):
    """The values that crashed vLLM's engine core before kvscope failed closed."""
    prompts, expected = answers_with_tracing_off
    _, endpoint = otlp_receiver  # http/json falls back to HTTP, which this gRPC port refuses
    spans = tmp_path / "spans"
    env = {"KVSCOPE_TRACING": "1", ENV_SPANS_DIR: str(spans),
           "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **BAD_VALUES}
    with user_server(tmp_path, env=env) as server:
        assert _answers(server, prompts) == expected
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "EngineCore encountered a fatal error" not in log
    stats = read_stats(spans)
    assert len(stats) >= 2, "engine core and worker (at least) wrote their stats"
    for variable, value in BAD_VALUES.items():
        per_pid = _lines_per_pid(log, f"{variable}={value!r}")
        assert per_pid and set(per_pid.values()) == {1}, (variable, per_pid)
        assert {s["pid"] for s in stats} <= set(per_pid), variable
        assert all(s["config_errors"].get(variable) == 1 for s in stats), (variable, stats)
    assert all("otlp" in s["exporters"] for s in stats), "http/json fell back to http/protobuf"
    assert sum(s["spans_ended"] for s in stats) > 0, "tracing still ran, on the fallbacks"


@pytest.mark.root
def test_a_pipeline_build_that_raises_leaves_answers_unchanged_counted_once(
        tmp_path, answers_with_tracing_off):
    """The build made to raise by the test-only KVSCOPE_FAULT_INJECTION, in every process."""
    prompts, expected = answers_with_tracing_off
    spans = tmp_path / "spans"
    env = {"KVSCOPE_TRACING": "1", ENV_SPANS_DIR: str(spans),
           failsafe.ENV_FAULTS: runtime.BUILD}
    with user_server(tmp_path, env=env) as server:
        assert _answers(server, prompts) == expected
    log = (tmp_path / "server.log").read_text(errors="replace")
    per_pid = _lines_per_pid(log, f"{runtime.BUILD}: InjectedFault")
    stats = read_stats(spans)
    assert stats and all(s["hook_errors"] == {runtime.BUILD: 1} and s["exporters"] == []
                         for s in stats), stats
    assert set(per_pid) == {s["pid"] for s in stats} and set(per_pid.values()) == {1}, per_pid
    assert not list(spans.glob("*.json")), "no pipeline, no spans"


@pytest.mark.root
def test_a_users_server_stopped_by_sigterm_with_a_shutdown_timeout_delivers_every_span(
        tmp_path, otlp_receiver):
    """`vllm serve --shutdown-timeout 15` stopped as `docker stop` or Kubernetes stop it (SIGTERM
    to the API server): each process flushes its exporters on its way out, so every span in
    the files reached the collector although none left before the exit flush."""
    receiver, endpoint = otlp_receiver
    spans = tmp_path / "spans"
    env = {"KVSCOPE_TRACING": "1", ENV_SPANS_DIR: str(spans),
           "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
           "OTEL_BSP_SCHEDULE_DELAY": "600000"}  # nothing leaves before the exit flush
    with user_server(tmp_path, env=env, args=["--shutdown-timeout", "15"]) as server:
        for i, prompt in enumerate(tiny_prompts(2) * 2):
            complete(server, prompt, headers={"traceparent": TRACEPARENT.format(i + 1)})
        os.kill(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=60)
    stats = [s for s in read_stats(spans) if s["spans_ended"]]
    assert len(stats) >= 2 and all(s["closed"] for s in stats), stats
    for s in stats:
        otlp = s["by_exporter"]["otlp"]
        assert otlp["exported"] == s["spans_ended"] and otlp["lost"] == 0, s
    assert set(_ours(receiver)) == _span_ids_in_files(spans)
