# SPDX-License-Identifier: Apache-2.0
"""Run selection and the TTFT breakdown per request. The page opens on the cold phases (the
study's question); the warm phase, one cold phase or all of them are one click away."""

from __future__ import annotations

from dash import dcc, html

from kvscope.dashboards import ids
from kvscope.dashboards.data import ALL, COLD
from kvscope.dashboards.figures import SORT_KEYS


def phase_options(phases: list[str]) -> list[dict[str, str]]:
    cold = [{"label": "cold phases", "value": COLD}] if any(p.startswith("cold") for p in phases) else []
    return cold + [{"label": p, "value": p} for p in phases] + [{"label": "all phases", "value": ALL}]


def controls(labels: list[str], phases: list[str], phase: str) -> html.Div:
    """Which runs (side by side), which phase (`phase` first), and the per-request order."""
    return html.Div(className="controls", children=[
        html.Label(["Runs", dcc.Checklist(id=ids.RUNS, options=labels, value=labels,
                                          inline=True, className="runs")]),
        html.Label(["Phase", dcc.RadioItems(id=ids.PHASE, options=phase_options(phases),
                                            value=phase, inline=True, className="runs")]),
        html.Label(["Sort requests by", dcc.Dropdown(id=ids.SORT, options=list(SORT_KEYS),
                                                     value="TTFT", clearable=False,
                                                     className="dropdown")]),
    ])


def layout(labels: list[str], phases: list[str], phase: str) -> html.Section:
    return html.Section(className="section", children=[
        controls(labels, phases, phase),
        dcc.Graph(id=ids.BREAKDOWN_GRAPH, className="graph tall",
                  config={"displaylogo": False}),
        html.P("Click a request to show its waterfall below.", className="hint"),
    ])
