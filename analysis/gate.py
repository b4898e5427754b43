"""The CI gate: a run's per-component statistics against a baseline with tolerances.

A baseline is JSON: {"phase": "cold" | null, "stat": "p50", "components": {"ttft": {"value_s":
1.2, "tolerance": 0.10}, ...}}. A component regresses when current > value * (1 + tolerance)
(+ `slack_s`, an absolute allowance for tiny components). Improvements never fail.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pandas as pd

from kvscope.analysis.compare import PARTS, STATS, rows

DEFAULT_TOLERANCE = 0.10
DEFAULT_SLACK_S = 0.001


def baseline_from(attribution: pd.DataFrame, *, phase: str | None = None, stat: str = "p50",
                  tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """A baseline that the given attribution passes, with one tolerance for every component."""
    values = _stats(attribution, phase, stat)
    return {"phase": phase, "stat": stat, "slack_s": DEFAULT_SLACK_S,
            "components": {p: {"value_s": v, "tolerance": tolerance} for p, v in values.items()}}


def read_baseline(path: str | Path) -> dict[str, Any]:
    """Load and check a baseline file; ValueError names what is wrong."""
    try:
        baseline = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"baseline {path} cannot be read ({e}); write one with --write-baseline") from None
    unknown = set(baseline.get("components", {})) - set(PARTS)
    if not baseline.get("components") or unknown or baseline.get("stat", "p50") not in STATS:
        raise ValueError(f"baseline {path}: components must be a non-empty subset of {list(PARTS)} "
                         f"(unknown: {sorted(unknown)}) and stat one of {sorted(STATS)}")
    return baseline


def check(attribution: pd.DataFrame, baseline: dict[str, Any]) -> pd.DataFrame:
    """One row per baseline component: baseline, current, limit (s) and ok / REGRESSED."""
    current = _stats(attribution, baseline.get("phase"), baseline.get("stat", "p50"))
    slack = float(baseline.get("slack_s", DEFAULT_SLACK_S))
    out = []
    for part, spec in baseline["components"].items():
        limit = spec["value_s"] * (1 + spec.get("tolerance", DEFAULT_TOLERANCE)) + slack
        out.append({"component": part, "baseline_s": spec["value_s"], "current_s": current[part],
                    "limit_s": limit, "change": current[part] / spec["value_s"] - 1
                    if spec["value_s"] else float("nan"),
                    "status": "ok" if current[part] <= limit else "REGRESSED"})
    return pd.DataFrame(out)


def _stats(attribution: pd.DataFrame, phase: str | None, stat: str) -> dict[str, float]:
    picked = rows(attribution, phase)
    if picked.empty:
        raise ValueError(f"no complete requests{f' in phase {phase!r}' if phase else ''} to check")
    return {p: float(STATS[stat](picked[f"{p}_ns"].to_numpy("float64")[None, :] / 1e9)[0])
            for p in PARTS}


def junit_xml(result: pd.DataFrame, name: str) -> str:
    """The check as JUnit XML: one testcase per component, a failure for each regression."""
    return junit(name, [(str(r.component), failure_message(r) if r.status != "ok" else None)
                        for r in result.itertuples()])


def junit(name: str, cases: list[tuple[str, str | None]]) -> str:
    """A JUnit testsuite: one testcase per (name, failure message or None when it passed)."""
    suite = ElementTree.Element("testsuite", name=name, tests=str(len(cases)),
                                failures=str(sum(m is not None for _, m in cases)))
    for case_name, message in cases:
        case = ElementTree.SubElement(suite, "testcase", classname=name, name=case_name)
        if message is not None:
            ElementTree.SubElement(case, "failure", message=message)
    return ElementTree.tostring(suite, encoding="unicode")


def failure_message(r: Any) -> str:
    return (f"{r.component}: {r.current_s:.4f} s > limit {r.limit_s:.4f} s "
            f"(baseline {r.baseline_s:.4f} s, {r.change:+.1%})")
