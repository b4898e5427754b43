# SPDX-License-Identifier: Apache-2.0
"""Pure figure builders for the chunk ledger: a request's chunks as a strip, and a run's miss
reasons over time. DataFrame in (rows of `chunk_ledger`, contract.rundir.CHUNK_LEDGER, with a
`run` column for the second), `go.Figure` out.

A chunk is named by what happened to it: `hit: <tier>` or `miss: <reason>`; the colours keep
hits cool and misses warm so a strip reads at a glance before any legend.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from kvscope.contract import chunk_outcomes
from kvscope.dashboards.figures import _require
from kvscope.dashboards.look import axes, axis_of, empty, figure, grid, text

HIT_COLORS = {chunk_outcomes.TIER_VLLM: "#2ca02c", chunk_outcomes.TIER_CPU: "#17becf", chunk_outcomes.TIER_DISK: "#1f77b4",
              chunk_outcomes.TIER_OTHER: "#9467bd"}
MISS_COLORS = dict(zip(chunk_outcomes.REASONS, (
    "#d62728", "#ff9896", "#ffbb78", "#ff7f0e", "#e377c2", "#8c564b", "#c49c94", "#bcbd22",
    "#f7b6d2", "#7f7f7f", "#dbdb8d", "#c7c7c7", "#393b79")))
STRIP_COLUMNS = ("chunk_index", "start_token", "end_token", "tokens", "tier", "reason",
                 "detail", "diverged_at")


def outcome(tier: str, reason: str) -> str:
    """The label of a chunk in the legend: `hit: disk`, `miss: evicted_disk`."""
    return f"miss: {reason}" if tier == chunk_outcomes.TIER_NONE else f"hit: {tier}"


def outcome_color(label: str) -> str:
    kind, name = label.split(": ", 1)
    return (HIT_COLORS if kind == "hit" else MISS_COLORS).get(name, "#7f7f7f")


def _hover(row: Any) -> str:
    lines = [f"chunk {row.chunk_index}: tokens {row.start_token}-{row.end_token}",
             text(outcome(row.tier, row.reason))]
    if row.detail:
        lines.append(text(row.detail))
    if row.diverged_at >= 0:
        lines.append(f"prefix diverged at token {row.diverged_at}")
    return "<br>".join(lines)


def build_chunk_strip(rows: pd.DataFrame, title: str = "Chunks of the request") -> go.Figure:
    """One bar segment per looked-up chunk along the prompt's tokens, coloured by the tier that
    served it or the reason it missed."""
    _require(rows, STRIP_COLUMNS, "build_chunk_strip")
    if rows.empty:
        return empty("no chunk ledger for this request (no LMCache lookup was traced)")
    rows = rows.sort_values("chunk_index", kind="stable")
    labels = [outcome(t, r) for t, r in zip(rows["tier"], rows["reason"])]
    data = []
    for label in dict.fromkeys(labels):  # first-seen order: the strip's own order
        part = rows[[lab == label for lab in labels]]
        data.append({
            "type": "bar", "x": part["tokens"].tolist(), "base": part["start_token"].tolist(),
            "y": ["chunks"] * len(part), "orientation": "h", "name": label,
            "marker": {"color": outcome_color(label), "line": {"color": "white", "width": 1}},
            "hovertext": [_hover(r) for r in part.itertuples(index=False)], "hoverinfo": "text"})
    return figure(data, {"barmode": "overlay", "height": 170, "yaxis": {"visible": False},
                         "xaxis": {"title": {"text": "prompt token"}}}, title)


def build_miss_reasons(ledger: pd.DataFrame, bins: int = 40,
                       title: str = "Chunk hits and miss reasons over time") -> go.Figure:
    """Tokens looked up per time bin (seconds since each run's first lookup), hits stacked by
    tier and misses by reason; one panel per run."""
    _require(ledger, ("run", "lookup_ns", "tokens", "tier", "reason"), "build_miss_reasons")
    if ledger.empty:
        return empty("no chunk ledger in these runs (runs before schema v4, or no LMCache "
                     "lookup traced)")
    runs = list(dict.fromkeys(ledger["run"]))
    layout = grid(len(runs), 1, [text(r) for r in runs], shared_xaxes=True,
                  vertical_spacing=0.08)
    data = []
    shown: set[str] = set()
    for i, run in enumerate(runs):
        part = ledger[ledger["run"] == run]
        seconds = (part["lookup_ns"] - part["lookup_ns"].min()) / 1e9
        edges = np.linspace(0.0, max(float(seconds.max()), 1e-3), bins + 1)
        which = np.clip(np.searchsorted(edges, seconds, side="right") - 1, 0, bins - 1)
        centers = (edges[:-1] + edges[1:]) / 2
        labels = pd.Series([outcome(t, r) for t, r in zip(part["tier"], part["reason"])],
                           index=part.index)
        for label in sorted(set(labels), key=lambda lab: (lab.startswith("miss"), lab)):
            tokens = np.bincount(which[(labels == label).to_numpy()],
                                 weights=part["tokens"][labels == label], minlength=bins)
            data.append({"type": "bar", "x": centers, "y": tokens, "name": label,
                         "legendgroup": label, "showlegend": label not in shown,
                         "marker": {"color": outcome_color(label)}, **axes(i)})
            shown.add(label)
        axis_of(layout, i, "y")["title"] = {"text": "tokens"}
    axis_of(layout, len(runs) - 1, "x")["title"] = {"text": "s since the run's first lookup"}
    layout.update(barmode="stack", bargap=0.05, height=140 + 220 * len(runs))
    return figure(data, layout, title)
