# SPDX-License-Identifier: Apache-2.0
"""The views that compare runs as a whole, one tab each: percentiles, throughput, means per
concurrency level, the chunk ledger, the storage device; the findings beneath, always shown.

One tab at a time because the browser draws only the open tab (dcc.Tabs mounts the selected
tab's children alone): with a study's six profiles these views are some twenty panels, and
drawing them all held the page's first render for seconds (bench/dashboard_render.py). Every
figure is still in the layout from the start, so opening a tab draws at once, with no callback.
"""

from __future__ import annotations

from dash import dcc, html

from kvscope.dashboards import ids

# tab value -> its label; the first opens with the page
TABS = {"percentiles": "Percentiles per component", "throughput": "Throughput",
        "concurrency": "Mean breakdown per concurrency", "chunks": "Chunks",
        "device": "Storage device"}


def _graph(graph_id: str) -> dcc.Graph:
    return dcc.Graph(id=graph_id, config={"displaylogo": False})  # height: the figure's


def _chunks() -> list:
    return [
        html.P("Tokens of the LMCache lookups in the selected runs and phase: the share each tier "
               "served, and each miss reason with the prefill it cost (missed tokens x the run's "
               "measured prefill time per token).", className="hint"),
        html.Div(id=ids.CHUNK_TABLE),
        _graph(ids.CHUNK_REASONS_GRAPH),
    ]


def _device(has_nvme: bool) -> list:
    """`has_nvme`: whether any loaded run recorded nvme_io (else the NVMe view is left out)."""
    nvme = (dcc.Graph(id=ids.NVME_GRAPH, className="graph", config={"displaylogo": False})
            if has_nvme else html.P("No run recorded NVMe commands (nvme_io.parquet): "
                                    "the per-queue view needs an NVMe host.", className="hint"))
    return [dcc.Graph(id=ids.DEVICE_GRAPH, className="graph", config={"displaylogo": False}),
            nvme]


def layout(has_nvme: bool) -> html.Section:
    content = {
        "percentiles": [_graph(ids.PERCENTILE_GRAPH)],
        "throughput": [dcc.Graph(id=ids.THROUGHPUT_GRAPH, className="graph",
                                 config={"displaylogo": False})],
        "concurrency": [_graph(ids.CONCURRENCY_GRAPH)],
        "chunks": _chunks(),
        "device": _device(has_nvme),
    }
    return html.Section(className="section", children=[
        dcc.Tabs(id=ids.VIEW_TABS, value=next(iter(TABS)), className="tabs", children=[
            dcc.Tab(label=label, value=value, children=content[value])
            for value, label in TABS.items()]),
        html.H2("Findings"),
        html.Div(id=ids.FINDINGS),
    ])
