"""vLLM's own timings per phase, from its Prometheus endpoint (sum and count deltas)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from kvscope.capture.workload.server import VLLMServer

HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:e2e_request_latency_seconds",
)
COUNTERS = ("vllm:prompt_tokens_by_source", "vllm:external_prefix_cache_hits",
            "vllm:external_prefix_cache_queries")

Sample = dict[str, float]


def scrape(server: "VLLMServer") -> Sample:
    """Flat {name[label=value]: value} for the histograms' sums/counts and the counters."""
    return parse(server.metrics_text())


def parse(text: str) -> Sample:
    """`scrape` on a /metrics page already fetched."""
    values: Sample = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base = sample.name.removesuffix("_sum").removesuffix("_count").removesuffix("_total")
            wanted = base in HISTOGRAMS and sample.name.endswith(("_sum", "_count"))
            if not wanted and base not in COUNTERS:
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k in ("source",))
            key = sample.name + (f"[{labels}]" if labels else "")
            values[key] = values.get(key, 0.0) + sample.value
    return values


def delta(before: Sample, after: Sample) -> Sample:
    return {k: round(v - before.get(k, 0.0), 6) for k, v in after.items()}
