"""Prometheus metrics of kvscope's stages on a user's server: scraped from vLLM's own /metrics,
their counts equal the requests sent."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from user_server import complete, tiny_prompts, user_server

from kvscope.workload import system
from kvscope.workload.runner import expected_chunks, wait_for_stores

pytestmark = [pytest.mark.live, pytest.mark.root]
CHUNKS_PER_PROMPT = 600 // 256
GRAFANA = Path(__file__).parents[2] / "docs" / "grafana" / "kvscope-stages.json"


def _samples(server) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name.startswith("kvscope_"):
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def _count(samples, stage: str) -> float:
    return samples.get(("kvscope_stage_duration_seconds_count", (("stage", stage),)), 0)


def test_stage_histograms_count_every_request_on_vllms_metrics(tmp_path):
    prompts = tiny_prompts(3, seed=51)
    with user_server(tmp_path, env={"KVSCOPE_TRACING": "1"}) as server:
        for prompt in prompts:
            complete(server, prompt, max_tokens=1)
        wait_for_stores(tmp_path / "kv", expected_chunks(prompts))
        system.drop_page_cache()
        for prompt in prompts:
            complete(server, prompt, max_tokens=1)
        sent = 2 * len(prompts)
        every = ("server_request", "server_ttft", "queue", "kv_lookup", "prefill")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # each process writes its snapshot every 200 ms
            samples = _samples(server)
            if all(_count(samples, s) >= sent for s in every) and \
                    _count(samples, "kv_load") >= len(prompts):
                break
            time.sleep(0.2)
    for stage in every:
        assert _count(samples, stage) == sent, (stage, samples)
    assert _count(samples, "kv_load") == len(prompts), "only the second round loaded"
    assert _count(samples, "storage_read") >= len(prompts)
    assert samples[("kvscope_storage_read_bytes_total", ())] > 0
    hits = samples[("kvscope_disk_backend_read_hits_total", ())]
    assert hits == len(prompts) * CHUNKS_PER_PROMPT
    inf = samples[("kvscope_stage_duration_seconds_bucket", (("le", "+Inf"), ("stage", "prefill")))]
    assert inf == sent
    exposed = {name for name, _ in samples}
    in_panels = set(re.findall(r"kvscope_[a-z_]+", GRAFANA.read_text()))
    assert in_panels and in_panels <= exposed, f"the Grafana panels query {in_panels - exposed}"
