"""Throughput per phase on requests with known rates, and the ratio's bootstrap interval."""

from __future__ import annotations

import pandas as pd
import pytest

from kvscope.analysis import throughput


def closed_loop(phase: str, n: int, concurrency: int, latency_s: float, *, start_s: float = 0.0,
                cached: int = 512, output: int = 4) -> pd.DataFrame:
    """`n` requests, `concurrency` at a time, each `latency_s` long, back to back."""
    rows = []
    for i in range(n):
        arrival = start_s + (i // concurrency) * latency_s
        rows.append({"request_id": f"{phase}-{i}", "phase": phase, "concurrency": concurrency,
                     "status": "ok", "prompt_tokens": 600, "cached_tokens": cached,
                     "output_tokens": output, "arrival_ns": int(arrival * 1e9),
                     "finish_ns": int((arrival + latency_s) * 1e9)})
    return pd.DataFrame(rows)


def test_rates_are_exact_for_a_known_closed_loop():
    # 16 requests, 4 at a time, 0.5 s each: 4 waves in 2 s -> 8 requests/s.
    requests = pd.concat([closed_loop("cold-c4", 16, 4, 0.5),
                          closed_loop("warm", 4, 1, 2.0, start_s=100.0, cached=0)])
    failed = closed_loop("cold-c4", 1, 4, 0.1).assign(status="error", request_id="x")
    rows = {r["phase"]: r for r in throughput.per_phase(pd.concat([requests, failed]))}
    cold = rows["cold-c4"]
    assert cold["requests"] == 16 and cold["wall_s"] == pytest.approx(2.0)
    assert cold["requests_per_s"] == pytest.approx(8.0)
    assert cold["storage_tokens_per_s"] == pytest.approx(8.0 * 512)
    assert cold["prompt_tokens_per_s"] == pytest.approx(8.0 * 600)
    assert cold["output_tokens_per_s"] == pytest.approx(8.0 * 4)
    assert cold["mean_in_flight"] == pytest.approx(4.0)
    assert rows["warm"]["requests_per_s"] == pytest.approx(0.5)
    assert rows["warm"]["storage_tokens_per_s"] == 0.0


def test_ratio_of_two_runs_with_its_interval():
    a = closed_loop("cold-c4", 32, 4, 0.5)
    b = closed_loop("cold-c4", 32, 4, 0.4)  # 25 % more requests per second
    b.loc[b.index % 2 == 0, "finish_ns"] -= int(0.05e9)  # some spread for the bootstrap
    table = throughput.ratio(a, b, "cold-c4", n_boot=500).set_index("metric")
    r = table.loc["requests_per_s"]
    assert r["a"] == pytest.approx(8.0)
    assert r["b"] == pytest.approx(32 / ((7 * 0.4 + 0.4)))
    assert r["ratio"] == pytest.approx(r["b"] / r["a"])
    assert r["ratio_lo"] < r["ratio"] < r["ratio_hi"]
    assert set(table.index) == set(throughput.METRICS)


def test_ratio_names_the_run_without_requests_in_the_phase():
    a = closed_loop("cold-c4", 8, 4, 0.5)
    with pytest.raises(ValueError, match="phase 'cold-c8' of A"):
        throughput.ratio(a, a, "cold-c8")
