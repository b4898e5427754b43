# SPDX-License-Identifier: Apache-2.0
"""Run selection and the TTFT views: per request, per concurrency level, percentiles, findings."""

from __future__ import annotations

from dash import dcc, html

from dashboards import ids
from dashboards.figures import SORT_KEYS


def controls(labels: list[str], phases: list[str]) -> html.Div:
    """Which runs (side by side), which phase, and the per-request sort order."""
    return html.Div(className="controls", children=[
        html.Label(["Runs", dcc.Checklist(id=ids.RUNS, options=labels, value=labels,
                                          inline=True, className="runs")]),
        html.Label(["Phase", dcc.Dropdown(id=ids.PHASE, options=phases, value=None,
                                          placeholder="all phases", className="dropdown")]),
        html.Label(["Sort requests by", dcc.Dropdown(id=ids.SORT, options=list(SORT_KEYS),
                                                     value="TTFT", clearable=False,
                                                     className="dropdown")]),
    ])


def layout(labels: list[str], phases: list[str]) -> html.Section:
    return html.Section(className="section", children=[
        controls(labels, phases),
        dcc.Graph(id=ids.BREAKDOWN_GRAPH, className="graph tall",
                  config={"displaylogo": False}),
        html.P("Click a request to show its waterfall below.", className="hint"),
        dcc.Graph(id=ids.PERCENTILE_GRAPH, className="graph", config={"displaylogo": False}),
        html.Div(className="row", children=[
            dcc.Graph(id=ids.CONCURRENCY_GRAPH, className="graph half",
                      config={"displaylogo": False}),
            html.Div(className="half", children=[html.H2("Findings"), html.Div(id=ids.FINDINGS)]),
        ]),
    ])
