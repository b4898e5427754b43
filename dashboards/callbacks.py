# SPDX-License-Identifier: Apache-2.0
"""Callbacks: connect component ids to the data selectors and figure builders, nothing more.

Each `update_*` is a plain function of the loaded runs and the inputs (tested directly);
`register` binds them to the app with the runs closed over.
"""

from __future__ import annotations

import re
from typing import Any

import flask
import pandas as pd
import plotly.graph_objects as go
import plotly.io.json
from dash import ClientsideFunction, Dash, Input, Output, State, dcc, html

from kvscope.dashboards import data, figures, ids, look, timeline
from kvscope.dashboards.data import RunData

TRACE_ID = re.compile(r"[0-9a-f]{32}")


@figures.one_at_a_time
def update_breakdown(runs: dict[str, RunData], labels: list[str] | None, phase: str | None,
                     sort_by: str) -> go.Figure:
    """Per-request TTFT breakdown of the selection."""
    return figures.build_breakdown(data.attribution_of(runs, labels, phase), sort_by=sort_by)


@figures.one_at_a_time
def update_summary_views(runs: dict[str, RunData], labels: list[str] | None, phase: str | None
                         ) -> tuple[go.Figure, go.Figure, go.Figure, html.Table | html.P]:
    """Per-concurrency means, percentiles, throughput and findings of the selection."""
    return (figures.build_concurrency(data.attribution_of(runs, labels, phase)),
            figures.build_percentiles(data.percentiles_of(runs, labels, phase)),
            figures.build_throughput(data.throughput_of(runs, labels, phase)),
            table(data.findings_of(runs, labels), "no findings for the selected runs"))


def table(frame: pd.DataFrame, if_empty: str) -> html.Table | html.P:
    """A plain HTML table; cell values are text nodes, so markup in them is shown, not run."""
    if frame.empty:
        return html.P(if_empty, className="hint")
    head = html.Thead(html.Tr([html.Th(str(c)) for c in frame.columns]))
    body = html.Tbody([html.Tr([html.Td(str(v)) for v in row])
                       for row in frame.itertuples(index=False)])
    return html.Table([head, body], className="table")


def update_request_options(runs: dict[str, RunData], labels: list[str] | None,
                           phase: str | None, search: str | None,
                           current: str | None) -> tuple[list[dict], str | None]:
    """Requests to pick from (slowest first, or matching the typed text); keep the current one
    while it is still in the selected runs and phase, else take the slowest."""
    options = data.request_options(runs, labels, phase, search, keep=current)
    if current in {o["value"] for o in options}:
        return options, current
    return options, options[0]["value"] if options else None


# The waterfall's figure JSON for a request key (`?key=`): what assets/waterfall.js fetches when
# the pointer rests on a request, so the click after it draws without a round trip.
WATERFALL_ROUTE = "/_kvscope/waterfall"


def jaeger_link(jaeger_url: str | None, trace_id: str) -> html.A | html.Span:
    """A link to the trace in Jaeger's UI ({url}/trace/{trace_id}) when one is configured."""
    if not jaeger_url:
        return html.Span("start with --jaeger-url to link traces to Jaeger", className="hint")
    if not TRACE_ID.fullmatch(trace_id):
        return html.Span("this request has no trace id (tracing was off)", className="hint")
    return html.A("open trace in Jaeger", href=f"{jaeger_url.rstrip('/')}/trace/{trace_id}",
                  target="_blank", rel="noopener noreferrer")


def _details(view: data.RequestView) -> html.Ul:
    row = view.row
    parts = [f"{c.replace('_', ' ')} {row[f'{c}_ns'] / 1e6:.1f}" for c in figures.COMPONENTS]
    items = [html.Li(f"TTFT {row['ttft_ns'] / 1e6:.1f} ms = " + " + ".join(parts) + " ms")]
    if row.get("partial"):
        items.append(html.Li(f"partial: {row.get('diagnostics', '')}"))
    items += [html.Li(note) for note in view.notes]
    return html.Ul(items, className="details")


@figures.one_at_a_time
def waterfall_of(runs: dict[str, RunData], key: str | None) -> dict:
    """The selected request's waterfall as figure JSON (no plotly objects on the click path).

    Raises:
        BadKey: `key` is not a request key at all.
        KeyError: no loaded request has this key.
    """
    if not key:
        return look.empty("no request selected").to_plotly_json()
    data.parse_key(key)
    try:
        view = data.request_of(runs, key)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise KeyError(f"no loaded request has the key {key!r}") from e
    title = look.text(f"{view.label} · {view.row['phase']} · {view.row['request_id']}: "
                         f"TTFT {view.row['ttft_ns'] / 1e6:.1f} ms")
    return timeline.build_waterfall_json(view.spans, view.io, view.depth, arrival_ns=view.arrival_ns,
                              first_token_ns=view.first_token_ns, title=title)


def update_request_details(runs: dict[str, RunData], key: str | None,
                           jaeger_url: str | None) -> tuple[Any, Any]:
    """The Jaeger link and breakdown text of the selected request (its waterfall is drawn in the
    browser from `waterfall_of`)."""
    if not key:
        return "", ""
    view = data.request_of(runs, key)
    return jaeger_link(jaeger_url, view.trace_id), _details(view)


def serve_waterfall(runs: dict[str, RunData], key: str | None) -> flask.Response:
    """`WATERFALL_ROUTE`'s answer: the figure JSON, 400 for a value that is no request key,
    404 for a key no loaded request has (the key picks a request in memory, never a path)."""
    try:
        fig = waterfall_of(runs, key)
    except data.BadKey as e:
        return flask.Response(str(e), status=400, mimetype="text/plain")
    except KeyError as e:
        return flask.Response(str(e.args[0]), status=404, mimetype="text/plain")
    return flask.Response(plotly.io.json.to_json_plotly(fig), mimetype="application/json")


@figures.one_at_a_time
def update_device(runs: dict[str, RunData], labels: list[str] | None) -> go.Figure:
    depth, reads = data.device_of(runs, labels)
    return timeline.build_device(depth, reads)


@figures.one_at_a_time
def update_nvme(runs: dict[str, RunData], labels: list[str] | None) -> go.Figure:
    nvme = data.nvme_of(runs, labels)
    if nvme is None:
        return look.empty("none of the selected runs recorded NVMe commands")
    return timeline.build_nvme(nvme)


def download(runs: dict[str, RunData], name: str, labels: list[str] | None,
             phase: str | None, key: str | None) -> dict:
    """The named shown table as CSV, from memory; the name picks a table, never a path."""
    view = data.request_of(runs, key) if key else None
    frames = {
        "attribution": lambda: data.attribution_of(runs, labels, phase),
        "percentiles": lambda: data.percentiles_of(runs, labels, phase),
        "findings": lambda: data.findings_of(runs, labels),
        "request spans": lambda: view.spans if view else pd.DataFrame(),
        "request block I/O": lambda: view.io if view else pd.DataFrame(),
    }
    if name not in frames:
        raise ValueError(f"unknown table {name!r}; one of {list(frames)}")
    filename = "kvscope-" + name.replace(" ", "-").replace("/", "") + ".csv"
    return dcc.send_data_frame(frames[name]().to_csv, filename, index=False)


def register(app: Dash, runs: dict[str, RunData], jaeger_url: str | None, has_nvme: bool) -> None:
    """Bind the update functions to the app's ids, with `runs` closed over."""
    # Every server callback below starts with prevent_initial_call: the layout holds the views
    # as the page opens (app.initial_views), so a page load builds no figure.
    @app.callback(Output(ids.BREAKDOWN_GRAPH, "figure"), Input(ids.RUNS, "value"),
                  Input(ids.PHASE, "value"), Input(ids.SORT, "value"),
                  prevent_initial_call=True)
    def _breakdown(labels, phase, sort_by):
        return update_breakdown(runs, labels, phase, sort_by)

    @app.callback(Output(ids.CONCURRENCY_GRAPH, "figure"), Output(ids.PERCENTILE_GRAPH, "figure"),
                  Output(ids.THROUGHPUT_GRAPH, "figure"),
                  Output(ids.FINDINGS, "children"), Input(ids.RUNS, "value"),
                  Input(ids.PHASE, "value"), prevent_initial_call=True)
    def _summary(labels, phase):
        return update_summary_views(runs, labels, phase)

    # The layout already holds the slowest request, its options and its waterfall: no call at
    # page load, so the waterfall draws at once instead of after a round trip (and after an
    # empty plot drawn while it came).
    @app.callback(Output(ids.REQUEST, "options"), Output(ids.REQUEST, "value"),
                  Input(ids.RUNS, "value"), Input(ids.PHASE, "value"),
                  Input(ids.REQUEST, "search_value"), State(ids.REQUEST, "value"),
                  prevent_initial_call=True)
    def _options(labels, phase, search, current):
        return update_request_options(runs, labels, phase, search, current)

    # In the browser (assets/waterfall.js): a click on the breakdown draws the waterfall fetched
    # when the pointer rested on the request, then sets only the dropdown's value (the possibly
    # 10k options are not resent); only the text beside the waterfall is a server callback.
    app.server.add_url_rule(WATERFALL_ROUTE, "kvscope_waterfall",
                            lambda: serve_waterfall(runs, flask.request.args.get("key")))
    app.clientside_callback(ClientsideFunction("kvscope", "prefetch"),
                            Output(ids.WATERFALL_PREFETCH, "data"),
                            Input(ids.BREAKDOWN_GRAPH, "hoverData"), prevent_initial_call=True)
    app.clientside_callback(ClientsideFunction("kvscope", "waterfall"),
                            Output(ids.WATERFALL_GRAPH, "figure"), Input(ids.REQUEST, "value"),
                            prevent_initial_call=True)

    @app.callback(Output(ids.JAEGER_LINK, "children"), Output(ids.REQUEST_DETAILS, "children"),
                  Input(ids.REQUEST, "value"), prevent_initial_call=True)
    def _request(key):
        return update_request_details(runs, key, jaeger_url)

    @app.callback(Output(ids.DEVICE_GRAPH, "figure"), Input(ids.RUNS, "value"),
                  prevent_initial_call=True)
    def _device(labels):
        return update_device(runs, labels)

    if has_nvme:
        @app.callback(Output(ids.NVME_GRAPH, "figure"), Input(ids.RUNS, "value"),
                      prevent_initial_call=True)
        def _nvme(labels):
            return update_nvme(runs, labels)

    @app.callback(Output(ids.DOWNLOAD, "data"), Input(ids.DOWNLOAD_BUTTON, "n_clicks"),
                  State(ids.DOWNLOAD_TABLE, "value"), State(ids.RUNS, "value"),
                  State(ids.PHASE, "value"), State(ids.REQUEST, "value"),
                  prevent_initial_call=True)
    def _download(_clicks, name, labels, phase, key):
        return download(runs, name, labels, phase, key)
