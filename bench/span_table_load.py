"""Benchmark: building a run's span table from the tracer's Parquet parts against parsing its
OTLP JSON span files, for the same run, in one process.

    .venv/bin/python bench/span_table_load.py [RUN] [--spans 50000] [--rounds 3]

Replays the spans of a recorded run (default: the `kvscope run` in
tests/capture/data/live-tiny-kvscope) through the tracer's file exporter into a temporary run,
copied until `--spans` spans (each copy with other trace and request ids) in batches of 512
spans as the SDK's batch processor exports them: a span file and its part per batch. Then
builds the cleaned span table (analysis.spantable.build, what `kvscope analyze` does the first
time it loads a run) with the parts, and with the parts moved aside (parsing every file),
alternately, `--rounds` times each, checks that the two tables are equal, and prints the best
wall time of each and their ratio, beside this machine's CPU model and load; then the same for
the step that parts replace alone (each file's rows, before the run's cleaning and the table's
writing, which both ways share).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from kvscope.analysis import spanstream, spantable
from kvscope.contract import rundir
from kvscope.contract import spantable as spec
from kvscope.testkit import span_replay

DEFAULT_RUN = Path(__file__).parents[1] / "tests" / "capture" / "data" / "live-tiny-kvscope"
BATCH_SPANS = 512  # OTEL_BSP_MAX_EXPORT_BATCH_SIZE's default
OFFSET_NS = 0  # the clock offset does not change the work


def cpu_model() -> str:
    """lscpu's "Model name", read where lscpu reads it."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _timed(build: Callable[[], Any], rounds: list[float]) -> Any:
    """What `build` gives; its wall time appended to `rounds`."""
    started = time.perf_counter()
    made = build()
    rounds.append(time.perf_counter() - started)
    return made


def _rows(span_files: list[Path]) -> list[pa.RecordBatch]:
    """Each span file's rows, before cleaning: the part of the build that parts replace."""
    return [spanstream.file_rows(path, OFFSET_NS)[0] for path in span_files]


def compare(run: Path, spans: int, rounds: int) -> dict[str, float]:
    """Seconds of the best build (and of reading the files' rows only) from parts and from
    the span files, and the spans, files and rows built."""
    per_copy = spantable.build(spantable.span_files(run), OFFSET_NS).num_rows
    with tempfile.TemporaryDirectory(prefix="kvscope-span-table-") as tmp:
        target = Path(tmp) / "run"
        made = span_replay.export_again(run / rundir.SPANS_DIR, target / rundir.SPANS_DIR,
                                        copies=max(1, -(-spans // per_copy)),
                                        batch_spans=BATCH_SPANS)
        span_files = spantable.span_files(target)
        parts, aside = target / rundir.SPANS_DIR / spec.PARTS_DIR, Path(tmp) / "aside"
        times: dict[str, list[float]] = {k: [] for k in ("parts", "json", "parts_rows",
                                                         "json_rows")}
        for _ in range(rounds):
            fast = _timed(lambda: spantable.build(span_files, OFFSET_NS), times["parts"])
            _timed(lambda: _rows(span_files), times["parts_rows"])
            parts.rename(aside)
            slow = _timed(lambda: spantable.build(span_files, OFFSET_NS), times["json"])
            _timed(lambda: _rows(span_files), times["json_rows"])
            aside.rename(parts)
        if not fast.equals(slow, check_metadata=True):
            raise SystemExit("the tables from parts and from span files differ: a bug")
    return {**{f"{k}_s": min(v) for k, v in times.items()}, "spans": made,
            "files": len(span_files), "rows": fast.num_rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", type=Path, default=DEFAULT_RUN)
    p.add_argument("--spans", type=int, default=50_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    found = compare(args.run, args.spans, args.rounds)
    spans = found["spans"]
    print(f"{spans:.0f} spans of {args.run.name} in {found['files']:.0f} span files "
          f"({found['rows']:.0f} rows in the table), best of {args.rounds}; {cpu_model()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    for what, key in (("span table built (analysis.spantable.build)", ""),
                      ("files' rows only (no cleaning, no table written)", "_rows")):
        parts_s, json_s = found[f"parts{key}_s"], found[f"json{key}_s"]
        print(f"  {what}: from parts {parts_s * 1e3:.0f} ms ({parts_s / spans * 1e6:.1f} us "
              f"a span), from the JSON {json_s * 1e3:.0f} ms ({json_s / spans * 1e6:.1f} us a "
              f"span): {json_s / parts_s:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
