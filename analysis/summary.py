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

_STRING, _INTEGER, _NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
_NUMBER_OR_NULL = {"type": ["number", "null"]}
_STRINGS = {"type": "array", "items": _STRING}


def _rows(required: list[str], **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "object", "required": required,
                                       "properties": properties}}


# The types readers of a summary.json rely on (the dashboard reads one back while it is
# current: analysis.outputs): a summary of another shape was not written by this analysis.
SUMMARY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["analysis_version", "inputs_fingerprint"],
    "properties": {
        "run_id": _STRING, "analysis_version": _STRING, "inputs_fingerprint": _STRING,
        "requests": {"type": "object", "properties": dict.fromkeys(
            ("total", "failed", "partial", "complete"), {"type": "integer", "minimum": 0})},
        "groups": _rows(["phase", "concurrency", "percentiles_ns"], phase=_STRING,
                        concurrency=_INTEGER, requests=_INTEGER,
                        percentiles_ns={"type": "object", "additionalProperties": {
                            "type": "object", "additionalProperties": _NUMBER}},
                        share_of_ttft={"type": "object",
                                       "additionalProperties": _NUMBER_OR_NULL}),
        "throughput": _rows(["phase", "concurrency"], phase=_STRING, concurrency=_INTEGER,
                            **dict.fromkeys(throughput.METRICS, _NUMBER_OR_NULL)),
        "findings": _rows(["id", "severity", "message"], id=_STRING, severity=_STRING,
                          message=_STRING),
        "chunk_ledger": {"type": ["object", "null"],
                         "properties": {"prefill_ns_per_token": _NUMBER_OR_NULL}},
        "problems": _STRINGS,
        "request_notes": {"type": "object", "additionalProperties": _STRINGS},
    },
}


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
