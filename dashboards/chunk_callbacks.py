# SPDX-License-Identifier: Apache-2.0
"""Callbacks of the chunk section: the selection's tally and miss reasons over time, and the
chunk strip of the selected request. Plain `update_*` functions, bound by `register`."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from dash import Dash, Input, Output, html

from kvscope.dashboards import chunks, data, figures, ids
from kvscope.dashboards.look import text
from kvscope.dashboards.callbacks import table
from kvscope.dashboards.data import RunData


@figures.one_at_a_time
def update_chunk_views(runs: dict[str, RunData], labels: list[str] | None, phase: str | None
                       ) -> tuple[html.Table | html.P, go.Figure]:
    """Per-tier hit rates and miss reasons (table), and tokens per outcome over time."""
    tally = data.chunk_tally_of(runs, labels, phase)
    shown = tally.assign(
        share=[f"{v * 100:.1f} %" if pd.notna(v) else "" for v in tally["share"]],
        ttft_cost_s=[f"{v:.2f}" if pd.notna(v) else "" for v in tally["ttft_cost_s"]])
    return (table(shown, "no chunk ledger in the selected runs and phase (runs before schema "
                         "v4, or no LMCache lookup traced)"),
            chunks.build_miss_reasons(data.chunk_ledger_of(runs, labels, phase)))


@figures.one_at_a_time
def update_chunk_strip(runs: dict[str, RunData], key: str | None) -> go.Figure:
    if not key:
        return chunks.build_chunk_strip(data.chunk_ledger_of(runs, []))
    return chunks.build_chunk_strip(data.chunks_of(runs, key),
                              f"Chunks of {text(data.parse_key(key)[2])}")


def register(app: Dash, runs: dict[str, RunData]) -> None:
    @app.callback(Output(ids.CHUNK_TABLE, "children"), Output(ids.CHUNK_REASONS_GRAPH, "figure"),
                  Input(ids.RUNS, "value"), Input(ids.PHASE, "value"), prevent_initial_call=True)
    def _views(labels, phase):
        return update_chunk_views(runs, labels, phase)

    @app.callback(Output(ids.CHUNK_STRIP_GRAPH, "figure"), Input(ids.REQUEST, "value"),
                  prevent_initial_call=True)
    def _strip(key):
        return update_chunk_strip(runs, key)
