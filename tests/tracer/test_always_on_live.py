"""Always-on tracing on a user's own server: tail sampling keeps the slow request and drops the
fast one, and an exporter process killed mid-run is started again while serving goes on.

One server (vLLM's own command line, plain HTTP, `OTEL_TRACES_SAMPLER=kvscope_tail`) serves
both tests, in order: the second stops it to read the final counts.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import psutil
import pytest
from kvscope.testkit.tracing import wait_until
from kvscope.testkit.user_server import complete, tiny_prompts, user_server

from kvscope.analysis.otlp import read_span_files
from kvscope.contract import semconv
from kvscope.tracer import pipeline
from kvscope.tracer.run import summarize_stats, wait_for_span_files

pytestmark = [pytest.mark.live, pytest.mark.root]

THRESHOLD_MS = 150  # tiny twin: an 8-token prompt alone ~20 ms, the last of 8 x 2000 ~0.5 s
SHORT, LONG, BURST = 8, 2000, 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("always-on")
    spans_dir = workdir / "spans"
    env = {"KVSCOPE_TRACING": "1", "KVSCOPE_SPANS_DIR": str(spans_dir),
           "OTEL_TRACES_SAMPLER": "kvscope_tail",
           "OTEL_TRACES_SAMPLER_ARG": f"ttft_ms={THRESHOLD_MS},percentile=none,ratio=0"}
    with user_server(workdir, env=env, profile="stock") as server:
        yield server, spans_dir


def _timed(server, prompt: list[int], request_id: str) -> float:
    """One request's latency (s): max_tokens=1, so it bounds the server's TTFT from above."""
    started = time.monotonic()
    complete(server, prompt, max_tokens=1, headers={"X-Request-Id": request_id})
    return time.monotonic() - started


def _burst(server, name: str, seed: int) -> dict[str, float]:
    """BURST long prompts at once: the later ones wait for the earlier ones' prefill."""
    prompts = tiny_prompts(BURST, LONG, seed=seed)
    with ThreadPoolExecutor(BURST) as pool:
        latencies = pool.map(lambda i: _timed(server, prompts[i], f"{name}-{i}"), range(BURST))
        return {f"{name}-{i}": latency for i, latency in enumerate(latencies)}


def _spans(spans_dir: Path) -> pd.DataFrame:
    wait_for_span_files(spans_dir)
    spans, problems = read_span_files(sorted(spans_dir.glob("*.json")), 0)
    assert problems == []
    return spans


def _exporters(server) -> list[psutil.Process]:
    return [p for p in map(psutil.Process, server.pids())
            if "kvscope.tracer.exporter" in " ".join(p.cmdline())]


def test_tail_sampling_keeps_the_slow_request_and_drops_the_fast_one(served):
    server, spans_dir = served
    _timed(server, tiny_prompts(1, SHORT, seed=9)[0], "warm-up")  # vLLM's first request is slow
    fast = {f"fast-{i}": _timed(server, p, f"fast-{i}")
            for i, p in enumerate(tiny_prompts(3, SHORT, seed=1))}
    slow = _burst(server, "slow", seed=2)
    assert max(fast.values()) * 1e3 < THRESHOLD_MS, f"fast requests were not fast here: {fast}"
    spans = _spans(spans_dir)
    servers = spans[spans["name"] == semconv.SPAN_SERVER_REQUEST]
    kept = {s.request_id: s.attributes[semconv.GEN_AI_TTFT] for s in servers.itertuples()}
    assert not set(fast) & set(spans["request_id"]), "a fast request left no span at all"
    assert all(ttft * 1e3 > THRESHOLD_MS for ttft in kept.values()), kept
    assert set(kept) & set(slow), f"kept {kept}; slow latencies {slow}"
    whole = spans[spans["request_id"].isin(kept)]
    assert {semconv.SPAN_QUEUE, semconv.SPAN_PREFILL, semconv.SPAN_FIRST_TOKEN} <= set(
        whole["name"]), "a kept request keeps the spans of every process"
    assert wait_until(lambda: summarize_stats(spans_dir).get("sampling", {}).get(
        "requests_pending") == 0, timeout_s=10)
    sampling = summarize_stats(spans_dir)["sampling"]
    assert sampling["requests_kept"].get("slow") == len(kept)
    assert sampling["requests_dropped"] == 1 + len(fast) + len(slow) - len(kept)  # + warm-up
    assert sampling["spans_added"] == sampling["spans_kept"] + sampling["spans_dropped"]
    assert sampling["spans_kept"] == len(whole) == len(spans)


def test_a_killed_exporter_is_started_again_serving_goes_on_and_the_loss_is_counted(served):
    server, spans_dir = served
    (exporter,) = _exporters(server)
    exporter.send_signal(signal.SIGKILL)
    exporter.wait(10)
    after = _burst(server, "after", seed=3)
    assert wait_until(lambda: len(_exporters(server)) == 1, timeout_s=30)
    (again,) = _exporters(server)
    assert again.pid != exporter.pid
    spans = _spans(spans_dir)
    kept = set(spans.loc[spans["name"] == semconv.SPAN_SERVER_REQUEST, "request_id"])
    assert kept & set(after), f"no request after the kill was traced (latencies {after})"
    server.stop()
    final = summarize_stats(spans_dir, final=True)
    assert final["hook_errors"].get("exporter.restart") == 1, final["hook_errors"]
    for stats in _process_stats(spans_dir):
        for name, counts in stats["by_exporter"].items():
            assert stats["spans_ended"] == counts["exported"] + counts["failed"] + \
                counts["dropped"] + counts["lost"] + counts["pending"], (name, stats)
    assert final["spans_exported"]["file"] + final["spans_lost"] + final["spans_dropped"] \
        == final["spans_ended"]


def _process_stats(spans_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (spans_dir / pipeline.STATS_DIR).glob("*.json")
            if "role" not in json.loads(p.read_text())]
