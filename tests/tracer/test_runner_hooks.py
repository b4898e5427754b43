"""The worker's spans come from the KV-connector interface, on both of vLLM's model runners.

vLLM 0.32 runs Model Runner V2 on CUDA hosts and V1 on vLLM-CPU, so a CPU suite never runs V2
by itself. Here vLLM's real glue for each runner (V2's `ActiveKVConnector`, V1's
`KVConnectorModelRunnerMixin`) is driven around a timed forward in a fresh interpreter with
kvscope's plugin on; the connector is a recording stand-in for LMCache (mocked: LMCache needs a
running engine), created through vLLM's own connector factory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.analysis.otlp import read_span_files
from kvscope.contract import semconv
from kvscope.tracer.instrumentor import SCHEDULER_HOOKS, WORKER_HOOKS

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    """(connector calls, forward windows, spans) of two steps per runner: sync loads, none."""
    spans_dir = tmp_path_factory.mktemp("spans")
    env = {**os.environ, "KVSCOPE_TRACING": "1", "KVSCOPE_SPANS_DIR": str(spans_dir),
           "KVSCOPE_CLOCK_OFFSET_NS": "0", "PYTHONPATH": str(HERE)}
    proc = subprocess.run([sys.executable, str(HERE / "runner_drive.py")], capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    spans, problems = read_span_files(sorted(spans_dir.glob("*.json")), 0)
    assert problems == []
    return out["calls"], out["forwards"], spans


def test_the_hooked_methods_are_the_connector_interface_of_the_pinned_vllm():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert all(callable(getattr(KVConnectorBase_V1, m, None))
               for m in (*SCHEDULER_HOOKS, *WORKER_HOOKS))


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("step", [0, 1], ids=["sync-loads", "no-sync-loads"])
def test_prefill_spans_cover_the_forward_between_the_connector_calls_standin_connector(
        driven, runner, step):
    calls, forwards, spans = driven
    window = next(f for f in forwards if f["runner"] == runner and f["step"] == step)
    before = [c for c in calls if c[2] <= window["start"]]
    after = [c for c in calls if c[1] >= window["end"]]
    prefills = spans[(spans["name"] == semconv.SPAN_PREFILL)
                     & spans["request_id"].str.startswith(f"{runner}-{step}-")]
    assert sorted(prefills["request_id"]) == [f"{runner}-{step}-load-then-prefill",
                                              f"{runner}-{step}-prefill-only"], "none for decode"
    tokens = {a[semconv.PREFILL_TOKENS] for a in prefills["attributes"]}
    assert tokens == {512, 256}
    for span in prefills.itertuples():
        assert before[-1][2] <= span.start_ns <= window["start"], "starts after the last call"
        assert window["end"] <= span.end_ns <= after[0][1], "ends before the next call"
    expected_last = "start_load_kv" if step == 0 else "bind_connector_metadata"
    assert before[-1][0] == expected_last
