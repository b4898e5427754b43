# SPDX-License-Identifier: Apache-2.0
"""One look for every figure, and figures assembled as plain JSON.

Plotly's figure objects validate every property each time one is set: building the opening
page's views one trace and one axis update at a time took seconds at start-up (a 2x4 subplot
grid alone ~70 ms, the template ~50-90 ms per figure; bench/dashboard_render.py). So the
builders write traces and layouts as dicts and `figure` validates each figure once; the grids
come from `make_subplots`, made once per shape. The template is plotly_white's layout without
automargin and one default of its traces (bars' white outline): the defaults of its other
trace types drew nothing here and were half of each figure's JSON, and what it left cost the
browser time at every draw (`template_layout`, `TRACE_DEFAULTS`).
"""

from __future__ import annotations

import copy
import functools
import html
from typing import Any

import plotly.graph_objects as go

PLOT_TEMPLATE = "plotly_white"
LEGEND = {"orientation": "h", "y": 1.07, "yanchor": "bottom", "x": 1, "xanchor": "right",
          "title": None}
MARGIN = {"l": 60, "r": 20, "t": 90, "b": 50}


def text(value: object) -> str:
    """A string safe to show in a Plotly figure: trace-provided markup is shown, not rendered."""
    return html.escape(str(value), quote=False)


@functools.cache
def template_layout() -> dict:
    """PLOT_TEMPLATE's layout as JSON (every figure's defaults for axes, colours, fonts),
    automargin off: each axis's automargin is a second layout pass per panel on every draw
    (about 300 ms of a six-panel breakdown's first draw in headless Chromium), so the figures
    keep MARGIN or size their own."""
    import plotly.io as pio

    layout = pio.templates[PLOT_TEMPLATE].layout.to_plotly_json()
    for axis in ("xaxis", "yaxis"):  # the template's axes are every x and y axis's defaults
        layout[axis] = {**layout[axis], "automargin": False}
    return layout


# The per-trace defaults kept from the template: the bars' white outline. Its fill patterns
# (bar marker.pattern, scatter fillpattern) draw nothing without a shape, yet Plotly styles
# every bar and trace for them: about 150 ms of the breakdown's first draw.
TRACE_DEFAULTS = {"bar": [{"marker": {"line": {"color": "white", "width": 0.5}}}]}


@functools.cache
def _template() -> go.layout.Template:
    return go.layout.Template(layout=template_layout(), data=TRACE_DEFAULTS)


@functools.cache
def style_json() -> dict:
    """The look as plain layout JSON for a figure that is never a plotly object (the click
    path): the caller sizes the margins (automargin is off)."""
    return {"template": {"layout": copy.deepcopy(template_layout())}, "legend": LEGEND,
            "margin": MARGIN}


def _title(title: str) -> dict:
    return {"text": title, "x": 0.01, "xanchor": "left"}


def figure(data: list[dict[str, Any]], layout: dict[str, Any], title: str) -> go.Figure:
    """A figure of plain trace and layout dicts, in the look (template, title, legend on top),
    validated once."""
    return go.Figure(data=data, layout={**layout, "template": _template(), "title": _title(title),
                                        "legend": LEGEND, "margin": MARGIN})


def style(fig: go.Figure, title: str) -> go.Figure:
    """The look for a figure plotly express built (facet titles bare: `run=a` shows `a`)."""
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    fig.update_layout(template=_template(), title=_title(title), legend=LEGEND, margin=MARGIN)
    return fig


def empty(message: str) -> go.Figure:
    """A blank figure that says why it is blank (never an unexplained empty plot)."""
    return figure([], {"xaxis": {"visible": False}, "yaxis": {"visible": False},
                       "annotations": [{"text": text(message), "showarrow": False, "x": 0.5,
                                        "y": 0.5, "xref": "paper", "yref": "paper",
                                        "font": {"size": 14}}]}, "")


@functools.lru_cache(maxsize=64)
def _grid(rows: int, cols: int, titles: int, options: tuple[tuple[str, Any], ...]) -> dict:
    from plotly.subplots import make_subplots

    layout = make_subplots(rows=rows, cols=cols, subplot_titles=[str(i) for i in range(titles)],
                           **dict(options)).to_plotly_json()["layout"]
    layout.pop("template", None)
    return layout


def grid(rows: int, cols: int, titles: list[str], *, facets: bool = False,
         **options: Any) -> dict:
    """`make_subplots`' layout for a rows x cols grid with one title per panel (in row-major
    order; fewer titles than cells leaves the rest untitled), as JSON of its own. Cell i's
    traces go on `axes(i)`. `facets`: the look plotly express gave facet columns (titles in
    the body's font, every x axis matched to the first), for views that were drawn that way."""
    layout = copy.deepcopy(_grid(rows, cols, len(titles), tuple(sorted(options.items()))))
    for note, title in zip(layout.get("annotations", []), titles):
        note["text"] = title
        if facets:
            note["font"] = {}
    if facets:
        for i in range(1, rows * cols):
            axis_of(layout, i, "x")["matches"] = "x"
    return layout


def axes(i: int) -> dict[str, str]:
    """The x and y axes of a grid's cell i (row-major from 0), as a trace names them."""
    n = "" if i == 0 else str(i + 1)
    return {"xaxis": f"x{n}", "yaxis": f"y{n}"}


def each_axis(layout: dict, letter: str, **props: Any) -> None:
    """Set `props` on every `letter` axis ("x" or "y") of a grid's layout."""
    for name, axis in layout.items():
        if name.startswith(f"{letter}axis"):
            axis.update(props)


def axis_of(layout: dict, i: int, letter: str) -> dict:
    """The layout dict of cell i's `letter` axis."""
    return layout[axes(i)[f"{letter}axis"].replace(letter, f"{letter}axis", 1)]
