"""Benchmark: TTFT median with tracing on, sampled at 1 %, and next to vLLM's own tracing, vs off.

    .venv/bin/python bench/tracing_overhead.py [--repeats 2] [--requests 48] [--phases warm,cold]
        [--variants off,on,on-1pct,on-vllm-otlp]

Runs the same `kvscope run` workload (tiny twin by default, stock backend, probes off) once per
variant in turn, `--repeats` rounds, so slow drift of the shared machine hits every variant
alike:
- `off`: `--no-tracing`;
- `on`: kvscope's tracing (every request sampled);
- `on-1pct`: kvscope's tracing with OTEL_TRACES_SAMPLER=parentbased_traceidratio,
  OTEL_TRACES_SAMPLER_ARG=0.01 (client and server);
- `on-vllm-otlp`: kvscope's tracing plus vLLM's own (`--otlp-traces-endpoint` to an OTLP/gRPC
  receiver in this process).
Prints per phase and variant the pooled TTFT median and p90, the ratio of the medians to `off`,
the best-run ratio, and the spans written per request. `cold` needs root (it drops the page
cache).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import socket
import tempfile
from pathlib import Path
from typing import Iterator

import pandas as pd

from kvscope import analysis
from kvscope.contract import rundir
from kvscope.capture.workload import runner
from kvscope.capture.workload.runner import RunOptions, execute
from kvscope.capture.workload.server import ServerConfig, ServerError
from kvscope.analysis.otlp import read_span_files
from kvscope.capture.record.otlp_receiver import OtlpListener

SAMPLED_1PCT = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "0.01"}
VARIANTS = ("off", "on", "on-1pct", "on-vllm-otlp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _variant(name: str, vllm_endpoint: str) -> Iterator[None]:
    """The environment (client and server inherit it) and vLLM arguments of one variant."""
    env = SAMPLED_1PCT if name == "on-1pct" else {}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    original = runner.ServerConfig
    if name == "on-vllm-otlp":  # `kvscope run` has no option for extra vLLM arguments
        runner.ServerConfig = functools.partial(  # type: ignore[misc]
            ServerConfig, extra_args=["--otlp-traces-endpoint", vllm_endpoint])
    try:
        yield
    finally:
        runner.ServerConfig = original  # type: ignore[misc]
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _execute(out: Path, tracing: bool, args: argparse.Namespace, attempts: int = 3) -> Path:
    """One run; a port taken between choosing and binding it (shared machine) is retried."""
    for attempt in range(attempts):
        target = out.with_name(f"{out.name}-{attempt}")
        opts = RunOptions(out=target, model=args.model, requests=args.requests,
                          concurrency=[args.concurrency], prompt_tokens=args.prompt_tokens,
                          phases=args.phases.split(","), kv_dir=out.with_name(out.name + "-kv"),
                          port=_free_port(), probes=False, tracing=tracing)
        try:
            return execute(opts)
        except ServerError as e:
            if "Address already in use" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _one(out: Path, variant: str, args: argparse.Namespace, vllm_endpoint: str) -> pd.DataFrame:
    tracing = variant != "off"
    with _variant(variant, vllm_endpoint):
        run = _execute(out, tracing, args)
    requests = rundir.read_table(run, "requests")
    failed = int((requests["status"] != "ok").sum())
    if failed:
        raise SystemExit(f"{failed} requests failed in {run}; see {run / 'server.log'}")
    requests["variant"] = variant
    requests["run"] = out.name
    if tracing:
        spans = analysis.load_run(run).spans
        counts = spans.groupby("request_id").size() if len(spans) else pd.Series(dtype=int)
        requests["spans"] = requests["request_id"].map(counts).fillna(0)
    return requests


def _report(table: pd.DataFrame, variants: list[str]) -> None:
    for phase, rows in table.groupby("phase"):
        ttft = rows.groupby("variant")["ttft_s"]
        median, p90 = ttft.median(), ttft.quantile(0.9)
        runs = rows.groupby(["variant", "run"])["ttft_s"].median().groupby("variant").min()
        for variant in variants:
            spans = rows.loc[rows["variant"] == variant, "spans"] if variant != "off" else None
            spans_text = "" if spans is None else (
                f"   spans/request {spans.mean():.2f} (min {spans.min():.0f}, "
                f"max {spans.max():.0f})")
            print(f"{phase:>5} {variant:>13}: TTFT median {median[variant] * 1e3:8.2f} ms "
                  f"(ratio {median[variant] / median['off']:.3f})   p90 "
                  f"{p90[variant] * 1e3:8.2f} ms   best-run median "
                  f"{runs[variant] * 1e3:8.2f} ms (ratio {runs[variant] / runs['off']:.3f})"
                  f"{spans_text}")
    runs = table.groupby(["phase", "run"], sort=False)["ttft_s"].median() * 1e3
    print("per-run TTFT medians (ms), in run order:",
          ", ".join(f"{phase}/{run} {ms:.1f}" for (phase, run), ms in runs.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--model", default="tiny")
    p.add_argument("--phases", default="warm,cold")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "off" not in variants:
        p.error(f"--variants: {unknown} unknown; choose from {', '.join(VARIANTS)} with off")
    frames = []
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as tmp:
        collected = Path(tmp) / "collector"  # a real OTLP/gRPC receiver (kvscope record's)
        listener = OtlpListener("127.0.0.1:0")
        listener.start(collected)
        try:
            for i in range(args.repeats):
                for variant in variants:
                    frames.append(_one(Path(tmp) / f"r{i}-{variant}", variant, args,
                                       f"http://127.0.0.1:{listener.port}"))
        finally:
            listener.stop()
        received, _ = read_span_files(sorted(collected.glob("*.json")), 0)
    print(f"{args.model} twin, concurrency {args.concurrency}, {args.requests} requests per "
          f"phase, {args.repeats} runs per variant, in turn; vLLM's own llm_request spans "
          f"received: {int((received['name'] == 'llm_request').sum())}")
    _report(pd.concat(frames, ignore_index=True), variants)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
