# SPDX-License-Identifier: Apache-2.0
"""The app factory: load the runs once, lay out the sections, register the callbacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from dash import Dash, html

from kvscope.dashboards import callbacks, chunk_callbacks, data, ids
from kvscope.dashboards.pages import download, overview, request, views

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
    options = data.request_options(runs, list(runs), phase)
    page = html.Main(className="page", children=[
        _header(runs),
        overview.layout(list(runs), data.phases(runs), phase),
        views.layout(has_nvme),
        request.layout(options),
        download.layout(),
    ])
    key = options[0]["value"] if options else None
    _fill(page, initial_views(runs, phase, key, jaeger_url, has_nvme))
    app.layout = page
    callbacks.register(app, runs, jaeger_url, has_nvme)
    chunk_callbacks.register(app, runs)
    return app


def initial_views(runs: dict[str, data.RunData], phase: str, key: str | None,
                  jaeger_url: str | None, has_nvme: bool) -> dict[tuple[str, str], Any]:
    """Every view of the page as it opens (all runs, the default phase, the slowest request),
    built once here: the page then draws at once, with no callback round trip and no figure
    built at its load (the server callbacks run only when a control changes)."""
    labels = list(runs)
    concurrency, percentiles, throughput, findings = callbacks.update_summary_views(
        runs, labels, phase)
    link, details = callbacks.update_request_details(runs, key, jaeger_url)
    chunk_table, reasons = chunk_callbacks.update_chunk_views(runs, labels, phase)
    views = {
        (ids.BREAKDOWN_GRAPH, "figure"): callbacks.update_breakdown(runs, labels, phase, "TTFT"),
        (ids.CONCURRENCY_GRAPH, "figure"): concurrency,
        (ids.PERCENTILE_GRAPH, "figure"): percentiles,
        (ids.THROUGHPUT_GRAPH, "figure"): throughput, (ids.FINDINGS, "children"): findings,
        (ids.JAEGER_LINK, "children"): link, (ids.REQUEST_DETAILS, "children"): details,
        (ids.CHUNK_TABLE, "children"): chunk_table, (ids.CHUNK_REASONS_GRAPH, "figure"): reasons,
        (ids.WATERFALL_GRAPH, "figure"): callbacks.waterfall_of(runs, key),
        (ids.CHUNK_STRIP_GRAPH, "figure"): chunk_callbacks.update_chunk_strip(runs, key),
        (ids.DEVICE_GRAPH, "figure"): callbacks.update_device(runs, labels),
    }
    if has_nvme:
        views[(ids.NVME_GRAPH, "figure")] = callbacks.update_nvme(runs, labels)
    return views


def _fill(component: Any, values: dict[tuple[str, str], Any]) -> None:
    """Set each (id, property) of `values` on the component of that id in the tree."""
    for (cid, prop), value in values.items():
        if getattr(component, "id", None) == cid:
            setattr(component, prop, value)
    children = getattr(component, "children", None)
    for child in children if isinstance(children, (list, tuple)) else [children]:
        if hasattr(child, "to_plotly_json"):
            _fill(child, values)
