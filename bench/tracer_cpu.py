"""Benchmark: CPU time per span of kvscope's tracer, on the serving thread, in the serving
process, and in the exporter process.

    .venv/bin/python bench/tracer_cpu.py [RUN] [--spans 20000]

Replays the server-side spans of a traced run (default: the recorded `kvscope run` in
tests/capture/data/live-tiny-kvscope) through the tracer exactly as a vLLM process makes them:
its runtime built from the environment (its rings, and the exporter process it starts writing
OTLP JSON files into a temporary spans directory), the server request span as tracer/frontend.py
makes it (the sampler's decision, the context for the engine, the span's record), every other
span through tracer/spans.record, with the recorded names, times and attributes, until
`--spans` spans. Prints the CPU time per span of the replaying thread (what a vLLM thread
pays), of the whole replaying process, and of the exporter process once it has exported every
span, beside the time of a fixed Python loop on this machine (to compare machines). Measured
on one thread, so the figure does not depend on how busy vLLM keeps the rest of the machine,
as the serving processes' CPU per request does (bench/tracing_overhead.py shows both).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from typing import Any

import psutil

from kvscope import analysis
from kvscope.contract import semconv
from kvscope.tracer import config, exporter_link, frontend, runtime, spans
from kvscope.tracer import run as tracer_run

DEFAULT_RUN = Path(__file__).parents[1] / "tests" / "capture" / "data" / "live-tiny-kvscope"
OWN_KEYS = (semconv.REQUEST_ID, semconv.VLLM_REQUEST_ID)  # RequestTrace adds them itself


Replay = list[tuple[str, dict[str, str], str, int, int, dict[str, Any]]]


def _server_spans(run: Path) -> Replay:
    """The run's server-side spans as (name, traceparent headers, vLLM request id, start,
    end, the attributes the tracer's caller passes), made before timing so that only the
    tracer's work is measured."""
    loaded = analysis.load_run(run).spans
    served = loaded[loaded["name"] != semconv.SPAN_CLIENT_REQUEST]
    if served.empty:
        raise SystemExit(f"{run} has no server-side spans to replay (was tracing on?)")
    out = []
    for row in served.sort_values("start_ns", kind="stable").itertuples(index=False):
        attributes = dict(row.attributes)
        parent = row.parent_span_id or "1" * 16
        passed = attributes if row.name == semconv.SPAN_SERVER_REQUEST else {
            k: v for k, v in attributes.items() if k not in OWN_KEYS}
        out.append((row.name, {"traceparent": f"00-{row.trace_id}-{parent}-01"},
                    str(attributes.get(semconv.VLLM_REQUEST_ID, row.request_id)),
                    int(row.start_ns), int(row.end_ns), passed))
    return out


def _replay(rt: runtime.Runtime, served: Replay) -> int:
    """Each span of `served` made as the tracer makes it in vLLM (a process reads a request's
    trace context from its headers once); returns how many."""
    traces: dict[str, spans.RequestTrace | None] = {}
    for name, headers, vllm_id, start_ns, end_ns, attributes in served:
        if name == semconv.SPAN_SERVER_REQUEST:
            opened = frontend._opened(rt, headers, start_ns)
            assert opened is not None
            opened.attributes.update(attributes)
            opened.first_token_ns = start_ns + (end_ns - start_ns) // 2
            frontend._finish(rt, opened, None, end_ns)
            continue
        request = traces.get(vllm_id)
        if request is None:
            request = traces[vllm_id] = spans.RequestTrace.from_headers(headers, vllm_id)
        assert request is not None
        spans.record(rt, name, request, start_ns, end_ns, attributes)
    return len(served)


def _exported(spans_dir: Path, made: int) -> bool:
    """Every span made so far is out of the exporter (its stats file says so)."""
    stats = tracer_run.summarize_stats(spans_dir)
    return stats["spans_ended"] >= made and stats["by_exporter"].get(
        "file", {}).get("pending", 1) == 0


def cpu_per_span(run: Path, total: int) -> dict[str, float]:
    """µs of CPU per span: `serving_thread` (the replaying thread), `process` (everything,
    once exported), and `reference_loop_ms` (a million additions, for comparing machines)."""
    served = _server_spans(run)
    with tempfile.TemporaryDirectory(prefix="kvscope-tracer-cpu-") as spans_dir:
        saved = {key: os.environ.get(key) for key in (config.ENV_SPANS_DIR,)}
        os.environ[config.ENV_SPANS_DIR] = spans_dir
        runtime.reset()
        try:
            rt = runtime.get()
            assert rt is not None, "the tracer did not build (see the log line above)"
            (exporter,) = [psutil.Process(s.process.pid) for s in exporter_link._supervisor]
            warm = _replay(rt, served)  # warm-up: imports, caches, the first files
            while not _exported(Path(spans_dir), warm):
                time.sleep(0.05)
            before = exporter.cpu_times()
            process, thread = time.process_time(), time.thread_time()
            made = 0
            while made < total:
                made += _replay(rt, served)
            thread = time.thread_time() - thread
            process = time.process_time() - process
            while not _exported(Path(spans_dir), warm + made):
                time.sleep(0.05)
            after = exporter.cpu_times()
            runtime.reset()
        finally:
            runtime.reset()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    loop = time.thread_time()
    counted = 0
    for number in range(1_000_000):
        counted += number
    exporting = after.user + after.system - before.user - before.system
    return {"serving_thread": thread / made * 1e6, "process": process / made * 1e6,
            "exporter": exporting / made * 1e6, "spans": made,
            "reference_loop_ms": (time.thread_time() - loop) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", type=Path, default=DEFAULT_RUN)
    p.add_argument("--spans", type=int, default=20_000)
    args = p.parse_args(argv)
    found = cpu_per_span(args.run, args.spans)
    print(f"{found['spans']:.0f} spans of {args.run.name} replayed: CPU per span "
          f"{found['serving_thread']:.1f} us on the serving thread, {found['process']:.1f} us "
          f"for the whole serving process, {found['exporter']:.1f} us in the exporter process; "
          f"a loop of 1e6 additions took "
          f"{found['reference_loop_ms']:.0f} ms here; load average "
          f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
