"""Findings: short sentences that say why TTFT went where it went (summary["findings"])."""

from __future__ import annotations

from typing import Any

import pandas as pd

from analysis.run import Run

Finding = dict[str, str]


def find(run: Run, attribution: pd.DataFrame, summary: dict[str, Any]) -> list[Finding]:
    """Every finding for the run, most severe first."""
    found: list[Finding] = []
    for rule in (_input_problems, _partial_rows, _unmatched_spans):
        found += rule(run, attribution, summary)
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(found, key=lambda f: order[f["severity"]])


def _finding(id_: str, severity: str, message: str) -> Finding:
    return {"id": id_, "severity": severity, "message": message}


def _input_problems(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    return [_finding("input", "warning", p) for p in run.problems]


def _partial_rows(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    partial = attribution["partial"].astype(bool)
    if len(attribution) == 0:
        return [_finding("no-requests", "error", "the run has no requests to attribute")]
    if not partial.any():
        return []
    reasons = attribution.loc[partial, "diagnostics"].str.split("; ").explode()
    top = reasons.str.replace(r"[\d.]+", "N", regex=True).value_counts().head(3)
    listed = "; ".join(f"{count} x {reason}" for reason, count in top.items())
    return [_finding("partial", "warning", f"{int(partial.sum())} of {len(attribution)} requests "
                     f"have partial attributions, left out of the percentiles: {listed}")]


def _unmatched_spans(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    unknown = ~run.spans["request_id"].isin(run.requests["request_id"].astype(str))
    if not unknown.any():
        return []
    ids = run.spans.loc[unknown, "request_id"].unique()
    return [_finding("unmatched-spans", "warning", f"{int(unknown.sum())} spans name "
                     f"{len(ids)} request ids that requests.parquet lacks (e.g. {ids[0]!r}); "
                     "they are not attributed")]
