"""Analyse a run and write its outputs into it (attribution.parquet, summary.json, report)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from analysis import report
from analysis.attribution import attribute
from analysis.run import load_run
from analysis.summary import ANALYSIS_VERSION, summarize
from kvscope import rundir

ATTRIBUTION_FILE = "attribution.parquet"
SUMMARY_FILE = "summary.json"


def analyze(path: str | Path, *, plots: bool = True) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Attribute and summarise the run at `path`, write the outputs, return both."""
    path = Path(path)
    run = load_run(path)
    attribution = attribute(run)
    summary = summarize(run, attribution)
    attribution.to_parquet(path / ATTRIBUTION_FILE, index=False)
    (path / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    if plots:
        report.write(path, attribution, summary)
    if run.manifest:
        rundir.update_manifest(path, "analysis", {"version": ANALYSIS_VERSION})
    return attribution, summary


def load_attribution(path: str | Path) -> pd.DataFrame:
    """The run's attribution.parquet, computing (not writing) it when absent."""
    path = Path(path)
    if (path / ATTRIBUTION_FILE).exists():
        return pd.read_parquet(path / ATTRIBUTION_FILE)
    return attribute(load_run(path))
