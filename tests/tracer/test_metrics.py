"""kvscope's /metrics families are the same whichever way vLLM serves /metrics.

vLLM serves prometheus_client's global registry, or, with PROMETHEUS_MULTIPROC_DIR set, only the
multiprocess files in that directory (its HTTP instrumentator builds a fresh registry over them
at every scrape). Each mode runs in a fresh interpreter (prometheus_client picks its value store
at import) that ends real spans through the plugin's processor and prints what a scrape shows.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).parents[2]
SCRAPE = """
import sys
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess
from kvscope.tracer import metrics
from kvscope.contract import semconv

metrics.start_in_this_process()
backend = {"read_hits": 3, "read_misses": 1, "corrupt_chunks": 2,
           "corrupt_by_reason": {"checksum": 2}}
provider = TracerProvider()
provider.add_span_processor(metrics.stage_metrics(lambda: [backend]))
tracer = provider.get_tracer("test")
for name, seconds, attributes in [
        (semconv.SPAN_SERVER_REQUEST, 0.3, {semconv.GEN_AI_TTFT: 0.02}),
        (semconv.SPAN_STORAGE_READ, 0.003, {semconv.READ_BYTES: 4096}),
        (semconv.SPAN_STORAGE_READ, 0.004, {semconv.READ_BYTES: 1024}),
        (semconv.SPAN_PREFILL, 0.5, {}), ("not.a.stage", 1.0, {})]:
    tracer.start_span(name, start_time=0, attributes=attributes).end(end_time=int(seconds * 1e9))
provider.shutdown()
if metrics.multiprocess_mode():
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
else:
    registry = REGISTRY
sys.stdout.write(generate_latest(registry).decode())
"""


def _scrape(env: dict[str, str]) -> dict[tuple[str, tuple], float]:
    proc = subprocess.run([sys.executable, "-c", SCRAPE], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(proc.stdout)
            if family.name.startswith("kvscope_") for s in family.samples
            if not s.name.endswith("_created")}


@pytest.mark.parametrize("mode", ["global registry", "multiprocess files"])
def test_a_scrape_shows_each_stage_the_read_bytes_and_the_backends_counters(tmp_path, mode):
    env = {"KVSCOPE_METRICS_DIR": str(tmp_path / "snapshots")}
    if mode == "multiprocess files":
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path / "prometheus")
        (tmp_path / "prometheus").mkdir()
    samples = _scrape(env)
    count = "kvscope_stage_duration_seconds_count"
    assert {labels[0][1]: value for (name, labels), value in samples.items()
            if name == count} == {"server_request": 1, "server_ttft": 1, "storage_read": 2,
                                  "prefill": 1}
    bucket = "kvscope_stage_duration_seconds_bucket"
    assert samples[(bucket, (("le", "0.0025"), ("stage", "storage_read")))] == 0
    assert samples[(bucket, (("le", "0.005"), ("stage", "storage_read")))] == 2
    assert samples[(bucket, (("le", "0.025"), ("stage", "server_ttft")))] == 1
    assert samples[("kvscope_stage_duration_seconds_sum", (("stage", "prefill"),))] == (
        pytest.approx(0.5))
    assert samples[("kvscope_storage_read_bytes_total", ())] == 5120
    assert samples[("kvscope_disk_backend_read_hits_total", ())] == 3
    assert samples[("kvscope_disk_backend_read_misses_total", ())] == 1
    assert samples[("kvscope_disk_backend_stores_total", ())] == 0
    assert samples[("kvscope_disk_backend_refused_chunks_total", (("reason", "checksum"),))] == 2


def test_grafana_panels_rate_over_grafanas_rate_interval():
    """A fixed `[1m]` window holds fewer than two samples at Prometheus's default 1 m scrape
    interval, so rate() is empty; `$__rate_interval` is at least four scrape intervals."""
    dashboard = json.loads((ROOT / "docs" / "grafana" / "kvscope-stages.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", ())]
    windows = [w for q in queries
               for w in re.findall(r"\b(?:rate|increase|irate)\([^\[]*\[([^\]]+)\]", q)]
    assert queries and len(windows) == len(queries)
    assert set(windows) == {"$__rate_interval"}, windows
