"""A process's tracer: never raises when it cannot be built, samples by OTEL_TRACES_SAMPLER,
and exports its last spans before a multiprocessing child (vLLM's engine core, worker) exits."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
from kvscope.testkit.tracing import wait_until

from kvscope.contract.env import ENV_CLOCK_OFFSET, ENV_SPANS_DIR
from kvscope.tracer import config, failsafe, frontend, pipeline, runtime, spans
from kvscope.contract import semconv
from kvscope.tracer.run import summarize_stats

RATIO = 0.25


@pytest.fixture(autouse=True)
def _fresh():
    failsafe.reset()
    config.reset()
    runtime.reset()
    yield
    failsafe.reset()
    config.reset()
    runtime.reset()


def test_a_pipeline_that_cannot_be_built_means_tracing_off_here_counted_once(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(ENV_SPANS_DIR, str(tmp_path))
    monkeypatch.setattr(failsafe, "_FAULTS", frozenset({runtime.BUILD}))
    with caplog.at_level(logging.WARNING, logger="kvscope.tracer.failsafe"):
        assert runtime.get() is None
        assert runtime.get() is None, "the failure is kept: no retry per call"
    assert failsafe.counts() == {runtime.BUILD: 1}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "InjectedFault" in lines[0] and "tracing is off" in lines[0]
    summary = summarize_stats(tmp_path, final=True)
    assert summary["hook_errors"] == {runtime.BUILD: 1} and summary["processes"] == 1


def test_a_bad_clock_offset_does_not_stop_the_runtime(monkeypatch, caplog):
    monkeypatch.setenv(ENV_CLOCK_OFFSET, "abc")
    rt = runtime.get()
    assert rt is not None and abs(rt.epoch(time.monotonic_ns()) - time.time_ns()) < 1e9
    assert failsafe.counts() == {failsafe.CONFIG + ENV_CLOCK_OFFSET: 1}


def test_parentbased_traceidratio_at_a_quarter_samples_exactly_the_traces_it_should(
        tmp_path, monkeypatch):
    """The API server decides (frontend._opened); an unsampled request is not recorded."""
    monkeypatch.setenv(ENV_SPANS_DIR, str(tmp_path))
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", str(RATIO))
    rt = runtime.get()
    assert rt is not None
    roots = [frontend._opened(rt, None, 1_000) for _ in range(400)]
    bound = round(RATIO * (1 << 64))  # TraceIdRatioBased: the low 64 bits of the trace id
    sampled = [r for r in roots if r is not None]
    assert all(r.trace_id & ((1 << 64) - 1) < bound for r in sampled)
    assert 50 < len(sampled) < 150
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0"
    children = [frontend._opened(rt, {"traceparent": caller + flag}, 1_000) for flag in "10"]
    assert children[0] is not None and children[1] is None, "a caller's traceparent decides"
    assert children[0].parent_id == 0xB7AD6B7169203331
    for request in [*sampled, children[0]]:
        frontend._finish(rt, request, None, 2_000)
    runtime.reset()
    stats = summarize_stats(tmp_path, final=True)
    assert stats["spans_ended"] == len(sampled) + 1
    assert stats["spans_exported"] == {"file": len(sampled) + 1}, "unsampled spans cost no export"


def child_main(env: dict[str, str], count: int, wait_for_sigterm: bool) -> None:
    """A multiprocessing child like vLLM's: builds its tracer, ends spans, returns or is
    SIGTERMed (vLLM's handler raises SystemExit). atexit never runs in such a child."""
    os.environ.update(env)

    def on_sigterm(signum, frame):
        raise SystemExit()

    signal.signal(signal.SIGTERM, on_sigterm)
    rt = runtime.get()
    request = spans.RequestTrace.from_headers(
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        "cmpl-r-0-0123abcd")
    assert request is not None
    for i in range(count):
        spans.record(rt, semconv.SPAN_QUEUE, request, 1_000 + i, 2_000 + i)
    if wait_for_sigterm:
        (Path(env[ENV_SPANS_DIR]) / "ready").touch()
        time.sleep(60)


def vllm_like_parent(env: dict[str, str], count: int, ending: str) -> None:
    """A fresh process (no gRPC state inherited from pytest) that forks a child, as vLLM's
    API server and engine core do, and ends it the way vLLM does: lets it return or SIGTERMs
    it. Exits with the child's exit code."""
    child = multiprocessing.get_context("fork").Process(
        target=child_main, args=(env, count, ending == "sigterm"))
    child.start()
    if ending == "sigterm":
        ready = Path(env[ENV_SPANS_DIR]) / "ready"
        wait_until(ready.exists, timeout_s=60)
        child.terminate()
    child.join(60)
    raise SystemExit(child.exitcode)


@pytest.mark.parametrize("ending", ["returns", "sigterm"])
def test_a_forked_child_exports_its_last_spans_before_it_exits(ending, tmp_path, otlp_receiver):
    receiver, endpoint = otlp_receiver
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint, ENV_SPANS_DIR: str(tmp_path),
           "OTEL_BSP_SCHEDULE_DELAY": "600000"}  # nothing leaves before the exit flush
    parent = multiprocessing.get_context("spawn").Process(target=vllm_like_parent,
                                                          args=(env, 25, ending))
    parent.start()
    parent.join(120)
    assert parent.exitcode == 0  # SystemExit() in the child is a clean exit
    assert len(receiver.spans()) == 25, "every span reached the collector"
    (stats_path,) = (tmp_path / pipeline.STATS_DIR).glob("vllm-*.json")
    stats = json.loads(stats_path.read_text())
    assert stats["closed"] is True and stats["spans_ended"] == 25
    assert {name: c["exported"] for name, c in stats["by_exporter"].items()} == {
        "file": 25, "otlp": 25}
    assert stats["spans_lost"] == 0 and stats["spans_dropped"] == 0
