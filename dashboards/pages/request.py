# SPDX-License-Identifier: Apache-2.0
"""One request: its spans, block I/Os and the device's in-flight depth on one time axis."""

from __future__ import annotations

from dash import dcc, html

from dashboards import ids


def layout() -> html.Section:
    return html.Section(className="section", children=[
        html.H2("One request"),
        dcc.Dropdown(id=ids.REQUEST, placeholder="pick a request (slowest first)",
                     clearable=False, className="dropdown wide"),
        html.Div(className="request-meta", children=[
            html.Div(id=ids.REQUEST_DETAILS), html.Div(id=ids.JAEGER_LINK)]),
        dcc.Graph(id=ids.WATERFALL_GRAPH, className="graph", config={"displaylogo": False}),
    ])
