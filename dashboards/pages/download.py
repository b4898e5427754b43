# SPDX-License-Identifier: Apache-2.0
"""Download of the tables the views show (CSV), and nothing else: no paths, no files."""

from __future__ import annotations

from dash import dcc, html

from kvscope.dashboards import ids

TABLES = ("attribution", "percentiles", "findings", "request spans", "request block I/O")


def layout() -> html.Section:
    return html.Section(className="section download", children=[
        html.H2("Download"),
        dcc.Dropdown(id=ids.DOWNLOAD_TABLE, options=list(TABLES), value=TABLES[0],
                     clearable=False, className="dropdown"),
        html.Button("Download CSV", id=ids.DOWNLOAD_BUTTON, n_clicks=0),
        dcc.Download(id=ids.DOWNLOAD),
    ])
