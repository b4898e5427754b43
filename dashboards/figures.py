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


def level_order(phases: pd.Series, concurrency: pd.Series) -> list[tuple[str, int]]:
    """(phase, concurrency) pairs in reading order: other phases (warm) first as they come,
    then the cold phases by concurrency as a number (1, 8, 16; never "c=16" before "c=8")."""
    pairs = list(dict.fromkeys(zip(phases.astype(str), concurrency.astype(int))))
    return sorted(pairs, key=lambda p: (p[0].startswith("cold"), p[1] if p[0].startswith("cold")
                                        else pairs.index(p)))


def line_of(run: str, phase: str) -> str:
    """A profile's line in the per-concurrency views: the run across its cold phases; any other
    phase (warm) is a point of its own."""
    return run if str(phase).startswith("cold") else f"{run} · {phase}"


def run_colors(runs: list[str]) -> dict[str, str]:
    """One colour per run, in the order given (stable across views and selections)."""
    palette = px.colors.qualitative.D3
    return {run: palette[i % len(palette)] for i, run in enumerate(runs)}


def _grid(panels: int, columns: int) -> tuple[int, int]:
    columns = max(1, min(columns, panels))
    return (panels + columns - 1) // columns, columns


def _cell(i: int, columns: int) -> dict[str, int]:
    return {"row": i // columns + 1, "col": i % columns + 1}


def build_concurrency(attribution: pd.DataFrame, columns: int = 3) -> go.Figure:
    """Mean TTFT components per concurrency level, one small panel per run (its warm phase a
    panel of its own), on one shared ms scale so the runs compare at a glance; the levels in
    numeric order. The means of the parts add up to the mean TTFT."""
    from plotly.subplots import make_subplots

    _require(attribution, ["run", "phase", "concurrency"] + [f"{c}_ns" for c in COMPONENTS],
             "the per-concurrency breakdown")
    if attribution.empty:
        return empty("no requests in the selected runs and phase")
    frame = attribution.assign(line=[line_of(r, p) for r, p in
                                     zip(attribution["run"], attribution["phase"])])
    means = (frame.groupby(["line", "phase", "concurrency"], as_index=False, sort=False)
             [[f"{c}_ns" for c in COMPONENTS]].mean())
    lines = list(dict.fromkeys(frame["line"]))
    rows, cols = _grid(len(lines), columns)
    fig = make_subplots(rows=rows, cols=cols, shared_yaxes="all", horizontal_spacing=0.04,
                        vertical_spacing=0.5 / rows if rows > 1 else 0.0,
                        subplot_titles=[text(line) for line in lines])
    for i, line in enumerate(lines):
        mine = means[means["line"] == line]
        order = level_order(mine["phase"], mine["concurrency"])
        mine = mine.set_index(["phase", "concurrency"]).loc[order]
        levels = [f"c={c}" for _, c in order]
        for component in COMPONENTS:
            fig.add_trace(go.Bar(
                x=levels, y=(mine[f"{component}_ns"] / 1e6).round(3).tolist(), name=component,
                marker_color=COLORS[component], legendgroup=component, showlegend=i == 0,
                hovertemplate=f"{component} %{{y:.1f}} ms<extra>{text(line)}</extra>"),
                **_cell(i, cols))
    fig.update_layout(barmode="stack", height=230 * rows + 130)
    fig.update_xaxes(type="category", title_text="")
    fig.update_yaxes(rangemode="tozero")
    fig.update_yaxes(title_text="mean ms", col=1)
    return _style(fig, "Mean TTFT breakdown per concurrency level (one panel per run)")


PANEL_COMPONENTS = ("ttft", *COMPONENTS)  # one panel each; the storage sub-parts stay in tables
SHOWN_PERCENTILES = {"p50": "solid", "p99": "dash"}  # p90 stays in the downloadable table


def build_percentiles(percentiles: pd.DataFrame, columns: int = 4) -> go.Figure:
    """One small panel per component (TTFT and its parts), each on its own ms scale:
    concurrency on a numeric (log) axis, one colour per run, p50 solid and p99 dashed. Many
    runs stay readable: no category labels to rotate, a legend entry per run."""
    from plotly.subplots import make_subplots

    _require(percentiles, ["run", "phase", "concurrency", "component", "percentile",
                           "value_ns"], "the percentile view")
    frame = percentiles[percentiles["component"].isin(PANEL_COMPONENTS)
                        & percentiles["percentile"].isin(SHOWN_PERCENTILES)]
    if frame.empty:
        return empty("analysis reported no percentiles for the selected runs")
    frame = frame.assign(ms=frame["value_ns"].astype("float64") / 1e6,
                         line=[line_of(r, p) for r, p in zip(frame["run"], frame["phase"])])
    shown = [c for c in PANEL_COMPONENTS if c in set(frame["component"])]
    colors = run_colors(list(dict.fromkeys(frame["run"])))
    levels = sorted({int(c) for c in frame["concurrency"]})
    rows, cols = _grid(len(shown), columns)
    fig = make_subplots(rows=rows, cols=cols, horizontal_spacing=0.06,
                        vertical_spacing=0.45 / rows if rows > 1 else 0.0,
                        subplot_titles=shown)
    for i, component in enumerate(shown):
        panel = frame[frame["component"] == component]
        for (line, run, stat), points in panel.groupby(["line", "run", "percentile"],
                                                        sort=False):
            points = points.sort_values("concurrency")
            warm = line != run
            fig.add_trace(go.Scatter(
                x=points["concurrency"].astype(int).tolist(), y=points["ms"].round(3).tolist(),
                mode="lines+markers", name=text(line), legendgroup=text(line),
                showlegend=i == 0 and stat == "p50",
                line={"color": colors[str(run)], "dash": SHOWN_PERCENTILES[str(stat)],
                      "width": 2},
                marker={"symbol": "diamond-open" if warm else "circle", "size": 7},
                hovertemplate=(f"{text(line)} {stat}: %{{y:.1f}} ms at c=%{{x}}"
                               "<extra></extra>")), **_cell(i, cols))
    fig.update_xaxes(type="log", tickvals=levels, ticktext=[str(c) for c in levels],
                     title_text="concurrency", title_standoff=2)
    fig.update_yaxes(rangemode="tozero", title_text="")
    fig.update_layout(height=250 * rows + 140)
    return _style(fig, "Percentiles per component (ms; p50 solid, p99 dashed; each panel on its "
                  "own scale)")


def build_throughput(throughput: pd.DataFrame) -> go.Figure:
    """Per metric (requests/s, prompt tokens/s from storage, output tokens/s): one panel, the
    phases on x and the runs side by side."""
    _require(throughput, ["run", "phase", "concurrency", "level", "metric", "value"],
             "the throughput view")
    if throughput.empty:
        return empty("analysis reported no throughput for the selected runs and phase")
    frame = throughput.assign(run=throughput["run"].map(text), level=throughput["level"].map(text))
    ordered = [text(f"{p} c={c}") for p, c in level_order(throughput["phase"],
                                                           throughput["concurrency"])]
    fig = px.bar(frame, x="level", y="value", color="run", facet_col="metric", barmode="group",
                 labels={**LABELS, "level": "", "value": ""},
                 color_discrete_map=run_colors(list(dict.fromkeys(frame["run"]))),
                 category_orders={"metric": list(dict.fromkeys(frame["metric"])),
                                  "level": ordered})
    fig.update_yaxes(matches=None, showticklabels=True, rangemode="tozero")
    return _style(fig, "Throughput per phase")
