# SPDX-License-Identifier: Apache-2.0
"""The storage device over the run: queue depth, read bandwidth, NVMe hardware queues."""

from __future__ import annotations

from dash import dcc, html

from kvscope.dashboards import ids


def layout(has_nvme: bool) -> html.Section:
    """`has_nvme`: whether any loaded run recorded nvme_io (else the NVMe view is left out)."""
    nvme = (dcc.Graph(id=ids.NVME_GRAPH, className="graph", config={"displaylogo": False})
            if has_nvme else html.P("No run recorded NVMe commands (nvme_io.parquet): "
                                    "the per-queue view needs an NVMe host.", className="hint"))
    return html.Section(className="section", children=[
        html.H2("Storage device"),
        dcc.Graph(id=ids.DEVICE_GRAPH, className="graph", config={"displaylogo": False}),
        nvme,
    ])
