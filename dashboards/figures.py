# SPDX-License-Identifier: Apache-2.0
"""Pure figure builders for the TTFT views: DataFrame in, `go.Figure` out.

No I/O, no Dash, no analysis here: the frames come from `analysis.attribute` / `summarize`
(with a `run` column added per loaded run), so every builder is testable without a server.
Strings that come from traces or directory names pass through `text()` before they reach a
figure, because Plotly renders a subset of HTML in labels and hover text.
"""

from __future__ import annotations

import functools
import html
import threading
from typing import Callable, TypeVar

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from kvscope.analysis.attribution import COMPONENTS  # in causal order; they sum to ttft_ns

COLORS = {
    "queueing": "#9e9e9e",
    "kv_lookup": "#8c6bb1",
    "storage_read": "#d62728",
    "transfer": "#ff7f0e",
    "prefill": "#1f77b4",
    "other": "#c7c7c7",
}
LABELS = {"ms": "ms", "component": "component", "run": "run", "rank": "request"}
# Sort keys of the per-request view: option label -> column of the attribution frame.
SORT_KEYS = {
    "arrival": "arrival_ns",
    "TTFT": "ttft_ns",
    **{name.replace("_", " "): f"{name}_ns" for name in COMPONENTS},
}
# Above this many requests per run, per-request bars become a stacked step area: bars thinner
# than a pixel look the same and ~60k SVG bars take seconds to draw (bench/dashboard_render.py).
MAX_BARS = 2000
PLOT_TEMPLATE = "plotly_white"


_Built = TypeVar("_Built")
# Plotly builds a template's defaults lazily into objects every figure shares, and that is not
# thread safe: callbacks drawing their first figures at once fail with ValueError("Invalid
# value") (plotly.py issue 3441; seen here as a 500 on a page's first load). Dash serves
# callbacks from threads, so figures are built one at a time (each takes milliseconds).
_BUILDING = threading.Lock()


def one_at_a_time(build: Callable[..., _Built]) -> Callable[..., _Built]:
    """`build`, holding the one figure-building lock while it runs."""
    @functools.wraps(build)
    def locked(*args: object, **kwargs: object) -> _Built:
        with _BUILDING:
            return build(*args, **kwargs)
    return locked


def text(value: object) -> str:
    """A string safe to show in a Plotly figure: trace-provided markup is shown, not rendered."""
    return html.escape(str(value), quote=False)


def _require(frame: pd.DataFrame, columns: list[str] | tuple[str, ...], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{what} needs columns {missing}; got {list(frame.columns)}")


LEGEND = {"orientation": "h", "y": 1.07, "yanchor": "bottom", "x": 1, "xanchor": "right",
          "title": None}
MARGIN = {"l": 60, "r": 20, "t": 90, "b": 50}


@functools.cache
def style_json() -> dict:
    """The look of `_style` as plain layout JSON, for figures built without plotly objects
    (the click path): the template's layout only, automargin off, so the caller sizes the
    margins. Per-trace defaults for every trace type and automargin's second layout pass were
    most of a click's redraw (bench/dashboard_render.py)."""
    import plotly.io as pio

    layout = pio.templates[PLOT_TEMPLATE].layout.to_plotly_json()
    for axis in ("xaxis", "yaxis"):  # the template's axes are every x and y axis's defaults
        layout[axis] = {**layout[axis], "automargin": False}
    return {"template": {"layout": layout}, "legend": LEGEND, "margin": MARGIN}


def _style(fig: go.Figure, title: str) -> go.Figure:
    """One look for every figure: white template, title, legend on top, facet titles bare."""
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    fig.update_layout(template=PLOT_TEMPLATE, title={"text": title, "x": 0.01, "xanchor": "left"},
                      legend=LEGEND, margin=MARGIN)
    return fig


def empty(message: str) -> go.Figure:
    """A blank figure that says why it is blank (never an unexplained empty plot)."""
    fig = go.Figure()
    fig.add_annotation(text=text(message), showarrow=False, x=0.5, y=0.5,
                       xref="paper", yref="paper", font={"size": 14})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _style(fig, "")


def _long_ms(frame: pd.DataFrame, ids: list[str]) -> pd.DataFrame:
    """Melt the `<component>_ns` columns to long form (component, ms) in causal order."""
    long = frame.melt(id_vars=ids, value_vars=[f"{c}_ns" for c in COMPONENTS],
                      var_name="component", value_name="ns")
    long["component"] = long["component"].str.removesuffix("_ns")
    long["ms"] = long["ns"].astype("float64") / 1e6
    return long.drop(columns="ns")


def build_breakdown(attribution: pd.DataFrame, *, sort_by: str = "TTFT",
                    max_bars: int = MAX_BARS) -> go.Figure:
    """TTFT per request as stacked components, one panel per run, requests in `sort_by` order.

    Each bar carries the request's `key` as customdata so a click can select the request.
    """
    column = SORT_KEYS.get(sort_by)
    if column is None:
        raise ValueError(f"sort_by {sort_by!r} is not one of {list(SORT_KEYS)}")
    _require(attribution, ["run", "key", "request_id", column]
             + [f"{c}_ns" for c in COMPONENTS], "the TTFT breakdown")
    if attribution.empty:
        return empty("no requests in the selected runs and phase")
    ordered = attribution.sort_values(["run", column], kind="stable", ascending=[True, sort_by == "arrival"])
    ordered = ordered.assign(rank=ordered.groupby("run", sort=False).cumcount(),
                             request=ordered["request_id"].map(text))
    long = _long_ms(ordered, ["run", "rank", "key", "request"])
    long["run"] = long["run"].map(text)
    long["ms"] = long["ms"].round(3)  # µs resolution; halves the JSON sent for 10k requests
    common = dict(x="rank", y="ms", color="component", facet_col="run",
                  custom_data=["key", "request"], color_discrete_map=COLORS,
                  category_orders={"component": list(COMPONENTS),
                                   "run": list(dict.fromkeys(attribution["run"].map(text)))},
                  labels={**LABELS, "rank": f"request (by {sort_by})"})
    if ordered.groupby("run").size().max() <= max_bars:
        fig = px.bar(long, **common)
        fig.update_layout(barmode="stack", bargap=0.1)
    else:
        fig = px.area(long, line_shape="hv", **common)
        fig.update_traces(line={"width": 0})
    for trace in fig.data:  # the key rides on the first component only: 1/6 of the bytes
        first = trace.name == COMPONENTS[0]
        trace.customdata = trace.customdata if first else None
        trace.hovertemplate = ("%{customdata[1]}: %{y:.2f} ms" if first else "%{y:.2f} ms")
    # A click anywhere above a request selects it (assets/waterfall.js, from the hover). No
    # clickmode: Plotly neither recomputes the hover nor emits an event Dash processes first. No
    # drag zoom by default (the modebar's zoom is one click away): its box, added at mousedown,
    # repaints the 10k-point areas and held the next frame ~200 ms (bench/dashboard_render.py).
    fig.update_layout(hovermode="x unified", clickmode="none", dragmode=False)
    return _style(fig, f"TTFT breakdown per request (sorted by {sort_by})")


def build_concurrency(attribution: pd.DataFrame) -> go.Figure:
    """Mean TTFT components per phase and concurrency level; means add up to the mean TTFT."""
    _require(attribution, ["run", "phase", "concurrency"] + [f"{c}_ns" for c in COMPONENTS],
             "the per-concurrency breakdown")
    if attribution.empty:
        return empty("no requests in the selected runs and phase")
    means = (attribution.groupby(["run", "phase", "concurrency"], as_index=False)
             [[f"{c}_ns" for c in COMPONENTS]].mean())
    means["level"] = means["phase"].map(text) + " c=" + means["concurrency"].astype(str)
    long = _long_ms(means, ["run", "level"])
    long["run"] = long["run"].map(text)
    fig = px.bar(long, x="level", y="ms", color="component", facet_col="run",
                 color_discrete_map=COLORS,
                 category_orders={"component": list(COMPONENTS),
                                  "run": list(dict.fromkeys(attribution["run"].map(text)))},
                 labels={**LABELS, "level": "phase, concurrency", "ms": "mean ms"})
    fig.update_layout(barmode="stack")
    fig.update_xaxes(matches=None)  # each run shows only its own levels
    return _style(fig, "Mean TTFT breakdown per concurrency level")


PANEL_COMPONENTS = ("ttft", *COMPONENTS)  # one panel each; the storage sub-parts stay in tables


def build_percentiles(percentiles: pd.DataFrame) -> go.Figure:
    """One panel per component (TTFT and its parts), each on its own scale: the series
    (run, group) side by side, p50 / p90 / p99 as grouped bars."""
    _require(percentiles, ["series", "component", "percentile", "value_ns"], "the percentile view")
    frame = percentiles[percentiles["component"].isin(PANEL_COMPONENTS)]
    if frame.empty:
        return empty("analysis reported no percentiles for the selected runs")
    frame = frame.assign(ms=frame["value_ns"] / 1e6, series=frame["series"].map(text))
    shown = [c for c in PANEL_COMPONENTS if c in set(frame["component"])]
    fig = px.bar(frame, x="series", y="ms", color="percentile", facet_col="component",
                 facet_col_wrap=4, facet_row_spacing=0.14, barmode="group",
                 labels={**LABELS, "series": ""}, category_orders={"component": shown},
                 color_discrete_sequence=["#1f77b4", "#ff7f0e", "#d62728"])
    fig.update_yaxes(matches=None, showticklabels=True, title_text="")
    fig.update_xaxes(tickangle=-30, showticklabels=True)
    fig.update_layout(height=300 * ((len(shown) + 3) // 4) + 120)
    return _style(fig, "Percentiles per component (ms; each panel on its own scale)")


def build_throughput(throughput: pd.DataFrame) -> go.Figure:
    """Per metric (requests/s, prompt tokens/s from storage, output tokens/s): one panel, the
    phases on x and the runs side by side."""
    _require(throughput, ["run", "level", "metric", "value"], "the throughput view")
    if throughput.empty:
        return empty("analysis reported no throughput for the selected runs and phase")
    frame = throughput.assign(run=throughput["run"].map(text), level=throughput["level"].map(text))
    fig = px.bar(frame, x="level", y="value", color="run", facet_col="metric", barmode="group",
                 labels={**LABELS, "level": "", "value": ""},
                 category_orders={"metric": list(dict.fromkeys(frame["metric"]))})
    fig.update_yaxes(matches=None, showticklabels=True, rangemode="tozero")
    return _style(fig, "Throughput per phase")
