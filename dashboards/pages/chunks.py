# SPDX-License-Identifier: Apache-2.0
"""The chunk ledger: which tier served each looked-up chunk, and why the others missed."""

from __future__ import annotations

from dash import dcc, html

from kvscope.dashboards import ids


def layout() -> html.Section:
    return html.Section(className="section", children=[
        html.H2("Chunks: which tier served them, why the others missed"),
        html.P("Tokens of the LMCache lookups in the selected runs and phase: the share each tier "
               "served, and each miss reason with the prefill it cost (missed tokens x the run's "
               "measured prefill time per token).", className="hint"),
        html.Div(id=ids.CHUNK_TABLE),
        dcc.Graph(id=ids.CHUNK_REASONS_GRAPH, config={"displaylogo": False}),
        html.H3("The selected request's chunks, in prompt order"),
        dcc.Graph(id=ids.CHUNK_STRIP_GRAPH, config={"displaylogo": False}),
    ])
