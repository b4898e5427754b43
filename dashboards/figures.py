# SPDX-License-Identifier: Apache-2.0
"""Pure figure builders for the TTFT views: DataFrame in, `go.Figure` out.

No I/O, no Dash, no analysis here: the frames come from `analysis.attribute` / `summarize`
(with a `run` column added per loaded run), so every builder is testable without a server.
Strings that come from traces or directory names pass through `text()` before they reach a
figure, because Plotly renders a subset of HTML in labels and hover text.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar

import numpy as np
import pandas as pd
from plotly.colors import qualitative
import plotly.graph_objects as go

from kvscope.analysis.attribution import COMPONENTS  # in causal order; they sum to ttft_ns
from kvscope.dashboards.look import axes, axis_of, each_axis, empty, figure, grid, text

COLORS = {
    "queueing": "#9e9e9e",
    "kv_lookup": "#8c6bb1",
    "storage_read": "#d62728",
    "transfer": "#ff7f0e",
    "prefill": "#1f77b4",
    "other": "#c7c7c7",
}
# Sort keys of the per-request view: option label -> column of the attribution frame.
SORT_KEYS = {
    "arrival": "arrival_ns",
    "TTFT": "ttft_ns",
    **{name.replace("_", " "): f"{name}_ns" for name in COMPONENTS},
}
# The breakdown draws at most this many requests across its panels, about one per pixel of the
# page's width: a run with more has its ranks binned and one request drawn per bin
# (`representatives`); more points than pixels look the same and each costs the browser time.
MAX_POINTS = 1200
MIN_POINTS_PER_RUN = 100  # a run's block keeps at least this many, however many runs
# Drawn requests up to which each is a bar (some 8 px wide or more at the page's width). Past
# it a bar is a sliver, and each is a path per component the browser styles at every draw
# (~2,000 for a seven-profile study: most of the breakdown's first draw), so the runs are
# stacked step areas instead, one path per component and run.
BAR_LIMIT = 150


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


def _require(frame: pd.DataFrame, columns: list[str] | tuple[str, ...], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{what} needs columns {missing}; got {list(frame.columns)}")


def representatives(ordered: pd.DataFrame, points: int, by: str) -> pd.DataFrame:
    """At most `points` of one run's requests (`ordered`: in rank order), with their `rank`:
    all of them when they fit, else the ranks cut into `points` equal bins and from each the
    request with the largest `by`. Each drawn stack is then a real request whose parts sum to
    its TTFT (what a click opens), and the largest is the one a human looks for: it keeps the
    spikes a bin's mean would flatten."""
    n = len(ordered)
    ranks = np.arange(n)
    if n <= points:
        return ordered.assign(rank=ranks)
    bins = ranks * points // n  # equal bins of consecutive ranks
    # within each bin, the largest `by` first (ties: the lower rank)
    order = np.lexsort((ranks, -ordered[by].to_numpy("float64"), bins))
    first = order[np.r_[True, bins[order][1:] != bins[order][:-1]]]
    return ordered.iloc[first].assign(rank=first)


def build_breakdown(attribution: pd.DataFrame, *, sort_by: str = "TTFT",
                    max_points: int = MAX_POINTS) -> go.Figure:
    """TTFT per request as stacked components, requests in `sort_by` order, the runs as blocks
    side by side on one axis (one request per unit, a gap between runs, each run's name above
    its block): one pair of axes however many runs, where a panel per run cost the browser a
    layout pass per axis at every draw (bench/dashboard_render.py).

    Up to BAR_LIMIT requests as bars (one trace per component); more as stacked step areas
    (one trace per component and run, so no stack bridges two runs). Up to `max_points`
    requests across the runs are drawn; a run with more is drawn through one request per bin
    of ranks (`representatives`: the one the sort puts first in its bin, or the slowest when
    sorted by arrival). Each drawn request carries its `key` as customdata so a click selects
    it (assets/waterfall.js).
    """
    column = SORT_KEYS.get(sort_by)
    if column is None:
        raise ValueError(f"sort_by {sort_by!r} is not one of {list(SORT_KEYS)}")
    _require(attribution, ["run", "key", "request_id", column]
             + [f"{c}_ns" for c in COMPONENTS], "the TTFT breakdown")
    if attribution.empty:
        return empty("no requests in the selected runs and phase")
    runs = list(dict.fromkeys(attribution["run"]))
    points = max(min(MIN_POINTS_PER_RUN, max_points), max_points // len(runs))
    by = "TTFT" if sort_by == "arrival" else sort_by
    counts = attribution["run"].value_counts()
    gap = 1 + len(attribution) // 50  # between two runs' blocks: ~2% of the axis
    starts = dict(zip(runs, np.cumsum([0] + [int(counts[run]) + gap for run in runs[:-1]])
                      .tolist()))
    drawn = {run: representatives(mine.sort_values(column, kind="stable",
                                                   ascending=sort_by == "arrival"),
                                  points, SORT_KEYS[by])
             for run, mine in attribution.groupby("run", sort=False)}
    binned = any(len(rows) < counts[run] for run, rows in drawn.items())
    areas = binned or sum(len(rows) for rows in drawn.values()) > BAR_LIMIT
    shown = [drawn[run].assign(x=drawn[run]["rank"] + starts[run]) for run in runs]
    if areas:  # a step per drawn request, the last one's to its block's end (its last rank)
        shown = [pd.concat([rows, rows.iloc[-1:].assign(x=starts[run] + int(counts[run]))])
                 for run, rows in zip(runs, shown)]
    data: list[dict[str, Any]] = []
    for i, rows in enumerate(shown if areas else [pd.concat(shown)]):
        names = rows["request_id"].map(text)
        for component in COMPONENTS:
            first = component == COMPONENTS[0]  # the key rides on one component: 1/6 the bytes
            trace: dict[str, Any] = {
                "name": component, "legendgroup": component, "showlegend": i == 0,
                "x": rows["x"].to_numpy("int64"),
                "y": (rows[f"{component}_ns"].to_numpy("float64") / 1e6).round(3),
                "hovertemplate": "%{customdata[1]}: %{y:.2f} ms" if first else "%{y:.2f} ms"}
            if first:
                trace["customdata"] = list(zip(rows["key"], names))
            if areas:  # a stack group per run: one shared group would stack every run's
                # traces at every run's x, adding zero points the hover reports as requests
                trace.update(type="scatter", mode="lines", stackgroup=str(i + 1),
                             line={"width": 0, "shape": "hv", "color": COLORS[component]})
            else:  # no outline: Plotly styles each bar's stroke at every draw
                trace.update(type="bar", marker={"color": COLORS[component], "line": {"width": 0}})
            data.append(trace)
    order = "in arrival order" if sort_by == "arrival" else f"by {sort_by}, largest first"
    layout = {
        "xaxis": {"title": {"text": f"requests {order}, one block per run"}, "showgrid": False,
                  "showticklabels": False, "zeroline": False,
                  "unifiedhovertitle": {"text": "TTFT parts"}},  # not the axis position
        "yaxis": {"title": {"text": "ms"}, "rangemode": "tozero"},
        "annotations": [{"text": text(run), "x": starts[run] + (counts[run] - 1) / 2,
                         "xref": "x", "y": 1.0, "yref": "paper", "yanchor": "bottom",
                         "showarrow": False} for run in runs],
        # A click anywhere above a request selects it (assets/waterfall.js, from the hover). No
        # clickmode: Plotly neither recomputes the hover nor emits an event Dash processes
        # first. No drag zoom by default (the modebar's zoom is one click away): its box, added
        # at mousedown, repaints the areas and held the next frame ~200 ms.
        "hovermode": "x unified", "clickmode": "none", "dragmode": False, "barmode": "stack",
        "bargap": 0.1}
    title = f"TTFT breakdown per request (sorted by {sort_by})"
    if binned:
        title += f"; {points} per run drawn, each the largest {by} of its bin of ranks"
    return figure(data, layout, title)


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
    palette = qualitative.D3
    return {run: palette[i % len(palette)] for i, run in enumerate(runs)}


def _shape(panels: int, columns: int) -> tuple[int, int]:
    columns = max(1, min(columns, panels))
    return (panels + columns - 1) // columns, columns


def build_concurrency(attribution: pd.DataFrame, columns: int = 3) -> go.Figure:
    """Mean TTFT components per concurrency level, one small panel per run (its warm phase a
    panel of its own), on one shared ms scale so the runs compare at a glance; the levels in
    numeric order. The means of the parts add up to the mean TTFT."""
    _require(attribution, ["run", "phase", "concurrency"] + [f"{c}_ns" for c in COMPONENTS],
             "the per-concurrency breakdown")
    if attribution.empty:
        return empty("no requests in the selected runs and phase")
    frame = attribution.assign(line=[line_of(r, p) for r, p in
                                     zip(attribution["run"], attribution["phase"])])
    means = (frame.groupby(["line", "phase", "concurrency"], as_index=False, sort=False)
             [[f"{c}_ns" for c in COMPONENTS]].mean())
    lines = list(dict.fromkeys(frame["line"]))
    rows, cols = _shape(len(lines), columns)
    layout = grid(rows, cols, [text(line) for line in lines], shared_yaxes="all",
                  horizontal_spacing=0.04, vertical_spacing=0.5 / rows if rows > 1 else 0.0)
    data = []
    for i, line in enumerate(lines):
        mine = means[means["line"] == line]
        order = level_order(mine["phase"], mine["concurrency"])
        mine = mine.set_index(["phase", "concurrency"]).loc[order]
        levels = [f"c={c}" for _, c in order]
        data += [{"type": "bar", "x": levels, "y": (mine[f"{component}_ns"] / 1e6).round(3).tolist(),
                  "name": component, "marker": {"color": COLORS[component]},
                  "legendgroup": component, "showlegend": i == 0,
                  "hovertemplate": f"{component} %{{y:.1f}} ms<extra>{text(line)}</extra>",
                  **axes(i)} for component in COMPONENTS]
    each_axis(layout, "x", type="category", title={"text": ""})
    each_axis(layout, "y", rangemode="tozero")
    for row in range(rows):
        axis_of(layout, row * cols, "y")["title"] = {"text": "mean ms"}
    layout.update(barmode="stack", height=230 * rows + 130)
    return figure(data, layout, "Mean TTFT breakdown per concurrency level (one panel per run)")


PANEL_COMPONENTS = ("ttft", *COMPONENTS)  # one panel each; the storage sub-parts stay in tables
SHOWN_PERCENTILES = {"p50": "solid", "p99": "dash"}  # p90 stays in the downloadable table


def build_percentiles(percentiles: pd.DataFrame, columns: int = 4) -> go.Figure:
    """One small panel per component (TTFT and its parts), each on its own ms scale:
    concurrency on a numeric (log) axis, one colour per run, p50 solid and p99 dashed (a warm
    phase: an open diamond). Many runs stay readable: no category labels to rotate, a legend
    entry per run."""
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
    rows, cols = _shape(len(shown), columns)
    layout = grid(rows, cols, shown, horizontal_spacing=0.06,
                  vertical_spacing=0.45 / rows if rows > 1 else 0.0)
    data = []
    for i, component in enumerate(shown):
        panel = frame[frame["component"] == component]
        for (line, run, stat), points in panel.groupby(["line", "run", "percentile"],
                                                        sort=False):
            points = points.sort_values("concurrency")
            trace = {
                "type": "scatter", "x": points["concurrency"].astype(int).tolist(),
                "y": points["ms"].round(3).tolist(), "mode": "lines",
                "name": text(line), "legendgroup": text(line),
                "showlegend": i == 0 and stat == "p50",
                "line": {"color": colors[str(run)], "dash": SHOWN_PERCENTILES[str(stat)],
                         "width": 2},
                "hovertemplate": f"{text(line)} {stat}: %{{y:.1f}} ms at c=%{{x}}<extra></extra>",
                **axes(i)}
            # Markers only on a point of its own (a warm phase, a single level): on a line the
            # ticks already say where the levels are, and each marker is an SVG node to style.
            if len(points) == 1:
                trace.update(mode="markers", marker={
                    "symbol": "circle" if line == run else "diamond-open", "size": 8})
            data.append(trace)
    # The levels padded in from the panel's edges (lines carry no markers to pad them): the
    # lowest level's tick label would otherwise sit under the y axis's 0.
    low, high = np.log10(levels[0]), np.log10(levels[-1])
    pad = max(high - low, 1.0) * 0.08
    each_axis(layout, "x", type="log", tickvals=levels, ticktext=[str(c) for c in levels],
              range=[low - pad, high + pad], title={"text": "concurrency", "standoff": 2})
    each_axis(layout, "y", rangemode="tozero", title={"text": ""})
    layout["height"] = 250 * rows + 140
    # short: with seven runs the legend beside it takes the rest of the row
    return figure(data, layout, "Percentiles per component, ms (p50 solid, p99 dashed)")


def build_throughput(throughput: pd.DataFrame) -> go.Figure:
    """Per metric (requests/s, prompt tokens/s from storage, output tokens/s): one panel, the
    phases on x and the runs side by side."""
    _require(throughput, ["run", "phase", "concurrency", "level", "metric", "value"],
             "the throughput view")
    if throughput.empty:
        return empty("analysis reported no throughput for the selected runs and phase")
    ordered = [text(f"{p} c={c}") for p, c in level_order(throughput["phase"],
                                                           throughput["concurrency"])]
    metrics = list(dict.fromkeys(throughput["metric"]))
    runs = list(dict.fromkeys(throughput["run"]))
    colors = run_colors(runs)
    layout = grid(1, len(metrics), [text(m) for m in metrics], facets=True,
                  horizontal_spacing=0.02)
    data = []
    for i, metric in enumerate(metrics):
        for run in runs:
            rows = throughput[(throughput["metric"] == metric) & (throughput["run"] == run)]
            data.append({"type": "bar", "x": rows["level"].map(text).tolist(),
                         "y": rows["value"].tolist(), "name": text(run), "legendgroup": text(run),
                         "showlegend": i == 0, "offsetgroup": text(run),
                         "marker": {"color": colors[run]},
                         "hovertemplate": f"{text(run)} %{{x}}: %{{y:.3g}} {text(metric)}"
                                          "<extra></extra>", **axes(i)})
    each_axis(layout, "x", type="category", categoryorder="array", categoryarray=ordered)
    each_axis(layout, "y", rangemode="tozero")
    layout["barmode"] = "group"
    return figure(data, layout, "Throughput per phase")
