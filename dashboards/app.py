# SPDX-License-Identifier: Apache-2.0
"""The app factory: load the runs once, lay out the sections, register the callbacks."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from dash import Dash, html

from kvscope.dashboards import callbacks, chunk_callbacks, data
from kvscope.dashboards.pages import chunks, device, download, overview, request

ASSETS = Path(__file__).with_name("assets")


def _header(runs: dict[str, data.RunData]) -> html.Header:
    return html.Header(className="header", children=[
        html.H1("kvscope · where TTFT goes"),
        html.Ul([html.Li(f"{label}: {rd.run.path} "
                         f"({len(rd.attribution)} requests, "
                         f"backend {rd.run.manifest.get('backend', {}).get('profile', '?')})")
                 for label, rd in runs.items()], className="runs-list"),
    ])


def create_app(run_dirs: Iterable[str | Path], *, jaeger_url: str | None = None) -> Dash:
    """A Dash app over the given run directories, each loaded once, here: from its analysis
    outputs when they are current, else analysed.

    Raises:
        data.DashboardError: a run cannot be read, or the Jaeger URL is not http(s);
            the message names it.
    """
    if jaeger_url and not jaeger_url.startswith(("http://", "https://")):
        raise data.DashboardError(f"Jaeger URL {jaeger_url!r} must start with http:// or https://")
    return build_app(data.load_runs(run_dirs), jaeger_url=jaeger_url)


def build_app(runs: dict[str, data.RunData], *, jaeger_url: str | None = None) -> Dash:
    """The app over runs already loaded by `data.load_runs`."""
    has_nvme = any(not rd.run.nvme_io.empty for rd in runs.values())
    app = Dash(__name__, title="kvscope dashboard", assets_folder=str(ASSETS),
               serve_locally=True)
    phase = data.default_phase(runs)
    app.layout = html.Main(className="page", children=[
        _header(runs),
        overview.layout(list(runs), data.phases(runs), phase),
        request.layout(data.request_options(runs, list(runs), phase)),
        chunks.layout(),
        device.layout(has_nvme),
        download.layout(),
    ])
    callbacks.register(app, runs, jaeger_url, has_nvme)
    chunk_callbacks.register(app, runs)
    return app
