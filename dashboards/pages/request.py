# SPDX-License-Identifier: Apache-2.0
"""One request: its spans, block I/Os and the device's in-flight depth on one time axis, and
its chunks along its prompt."""

from __future__ import annotations

from dash import dcc, html

from kvscope.dashboards import ids


def layout(options: list[dict[str, str]]) -> html.Section:
    """`options`: the first request choices, slowest first; the slowest is selected."""
    return html.Section(className="section", children=[
        html.H2("One request"),
        dcc.Dropdown(id=ids.REQUEST, options=options,
                     value=options[0]["value"] if options else None,
                     placeholder="type to search every request", clearable=False,
                     className="dropdown wide"),
        html.Div(className="request-meta", children=[
            html.Div(id=ids.REQUEST_DETAILS), html.Div(id=ids.JAEGER_LINK)]),
        html.P("I/O lanes: light while queued in the block layer, dark while on the device.",
               className="hint"),
        dcc.Graph(id=ids.WATERFALL_GRAPH, config={"displaylogo": False}),  # height: the figure's
        dcc.Store(id=ids.WATERFALL_PREFETCH),
        html.H3("Its chunks, in prompt order: the tier that served each, or why it missed"),
        dcc.Graph(id=ids.CHUNK_STRIP_GRAPH, config={"displaylogo": False}),
    ])
