"""Per-run summary: percentiles per component, device statistics and findings, as a dict.

Everything in it is JSON-ready (summary.json); docs/run-directory.md lists the keys.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from kvscope.analysis import device, findings, ledger, readpath, throughput
from kvscope.analysis.attribution import BATCH_PARTS, COMPONENTS, STORAGE_PARTS
from kvscope.analysis.run import Run

# 2: batch-aware (waiting on the same worker's other requests); 3: throughput per phase, queue
# depth per phase, the study's device ceiling; 4: the chunk ledger (attribution's hit / missed
# token columns, summary chunk_ledger, chunk_ledger.parquet)
ANALYSIS_VERSION = "4"
SUMMARY_COMPONENTS = ("ttft", *COMPONENTS, *STORAGE_PARTS, *BATCH_PARTS)
QUANTILES = (50, 90, 99)


def percentiles(attribution: pd.DataFrame) -> dict[str, dict[str, float]]:
    """p50/p90/p99/mean (ns) of TTFT and every component over the rows given."""
    out = {}
    for name in SUMMARY_COMPONENTS:
        values = attribution[f"{name}_ns"].dropna().astype("float64")
        stats = {f"p{q}": float(values.quantile(q / 100)) for q in QUANTILES} if len(values) else {}
        out[name] = {**stats, "mean": float(values.mean())} if len(values) else {}
    return out


def _groups(attribution: pd.DataFrame) -> list[dict[str, Any]]:
    """Per (phase, concurrency) of complete rows: counts, percentiles and share of TTFT."""
    complete = attribution[~attribution["partial"].astype(bool)]
    out = []
    for _, group in complete.groupby(["phase", "concurrency"], sort=False):
        phase, concurrency = group["phase"].to_numpy()[0], group["concurrency"].to_numpy()[0]
        total = float(group["ttft_ns"].sum())
        share = {c: float(group[f"{c}_ns"].sum()) / total if total else None
                 for c in (*COMPONENTS, *BATCH_PARTS)}
        out.append({"phase": str(phase), "concurrency": int(concurrency), "requests": len(group),
                    "percentiles_ns": percentiles(group), "share_of_ttft": share})
    return out


def summarize(run: Run, attribution: pd.DataFrame) -> dict[str, Any]:
    """The run's summary: request counts, per-group percentiles, device stats, findings."""
    depth = device.depth_distribution(run.queue_depth)
    failed = attribution["ttft_ns"].isna()
    summary = {
        "run_id": run.manifest.get("run_id", run.path.name),
        "analysis_version": ANALYSIS_VERSION,
        "requests": {"total": len(attribution), "failed": int(failed.sum()),
                     "partial": int(attribution["partial"].astype(bool).sum()),
                     "complete": int((~attribution["partial"].astype(bool)).sum())},
        "groups": _groups(attribution),
        "read_bandwidth": device.read_bandwidth(run.block_io),
        "queue_depth": depth,
        "queue_depth_by_phase": device.depth_by_phase(run.queue_depth),
        "throughput": throughput.per_phase(run.requests),
        "read_path": readpath.per_phase(run.block_io, run.spans, run.requests),
        "littles_law": device.littles_law(run.block_io, depth),
        "chunk_ledger": ledger.summarize(ledger.of_run(run), run.spans),
        "problems": list(run.problems),
    }
    summary["findings"] = findings.find(run, attribution, summary)
    return summary
