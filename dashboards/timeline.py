# SPDX-License-Identifier: Apache-2.0
"""Pure figure builders for the time views: one request's waterfall, device depth, NVMe queues.

Times are CLOCK_MONOTONIC ns in (docs/run-directory.md); figures show ms since the request's
arrival (waterfall) or seconds since the run's first event (device views). Plotly's date axes do
not fit relative times, so intervals are horizontal bars with `base=start`.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from kvscope.dashboards.figures import COLORS, _require, run_colors
from kvscope.dashboards.look import axes, empty, figure, grid, style, style_json, text

# Span name (without the `kvscope.` prefix) -> TTFT component colour.
SPAN_COLORS = {
    "client.request": "#e0e0e0",
    "queue": COLORS["queueing"],
    "kv.lookup": COLORS["kv_lookup"],
    "kv.load": "#f4a6a6",
    "storage.read": COLORS["storage_read"],
    "kv.transfer": COLORS["transfer"],
    "prefill": COLORS["prefill"],
    "kv.store": "#17becf",
    "first_token": "#000000",
}
IO_COLORS = {"I/O queued": "#fdd0a2", "I/O on device": "#7f2704"}
DEVICE_BINS = 600  # points per time series: about one per pixel of a wide plot
PLOT_PX = 1200  # about the waterfall's plot width: I/Os closer than a pixel are one segment
LANE_PX = 26  # a lane's height at least; more lanes than fit in WATERFALL_PX make it taller
LABEL_PX = 7  # width of a lane label's character at Plotly's 12 px font: the left margin
# One size for every request's waterfall (up to FIXED_LANES lanes, e.g. "storage.read #12"):
# a figure of another height or margin makes Plotly replot it whole and dcc.Graph's resize
# handler redraw it once more when its div changed size (bench/dashboard_render.py).
FIXED_LANES, FIXED_LABEL_CHARS = 16, 16
MARGIN_T, MARGIN_B = 60, 50
WATERFALL_PX = LANE_PX * FIXED_LANES + 200
LANES_DOMAIN, DEPTH_DOMAIN = [0.2655, 1.0], [0.0, 0.2145]  # the lanes above the depth lane


def _lanes(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Greedy interval packing: the first lane free at each start, so overlaps stay visible."""
    lane_ends: list[int] = []
    lanes = np.empty(len(starts), dtype=int)
    for i in np.argsort(starts, kind="stable"):
        free = next((k for k, end in enumerate(lane_ends) if end <= starts[i]), len(lane_ends))
        if free == len(lane_ends):
            lane_ends.append(ends[i])
        lane_ends[free] = ends[i]
        lanes[i] = free
    return lanes


def _span_bars(spans: pd.DataFrame, arrival_ns: int) -> tuple[dict, list[str]]:
    """Every span as one horizontal bar of one trace, coloured by its name (plain JSON, no plotly
    validation): each trace is a layer Plotly builds and styles on every redraw, so one trace,
    not one per span name. Its lanes are the span names, "#n" from a name's second span on."""
    ordered = spans.sort_values(["start_ns", "end_ns"], kind="stable")
    short = ordered["name"].astype(str).str.removeprefix("kvscope.")
    nth = short.groupby(short).cumcount()
    lanes = [text(s if n == 0 else f"{s} #{n + 1}") for s, n in zip(short, nth)]
    bars = {"type": "bar", "orientation": "h", "name": "spans", "y": lanes,
            "base": ((ordered["start_ns"] - arrival_ns) / 1e6).astype(float).tolist(),
            "x": ((ordered["end_ns"] - ordered["start_ns"]) / 1e6).astype(float).tolist(),
            "marker": {"color": [SPAN_COLORS.get(name, "#7f7f7f") for name in short]},
            "hovertemplate": "%{y}<br>start %{base:.2f} ms<br>duration %{x:.2f} ms<extra></extra>",
            "xaxis": "x", "yaxis": "y"}
    return bars, lanes


def _segments(name: str, lanes: list[str], start_ms: np.ndarray, end_ms: np.ndarray,
              hover: list[str], width_px: float) -> dict:
    """Intervals as one trace of line segments (start, end, gap), each as thick as a bar: plain
    paths, without the bar layout Plotly computes for every bar of a bar trace."""
    def spaced(first, second) -> list:
        out = [None] * (3 * len(lanes))
        out[0::3], out[1::3] = first, second
        return out

    return {"type": "scatter", "mode": "lines", "name": name, "legendgroup": "io",
            "x": spaced(start_ms.tolist(), end_ms.tolist()), "y": spaced(lanes, lanes),
            "hovertext": spaced(hover, hover), "hovertemplate": f"{name}<br>%{{hovertext}}<extra></extra>",
            "line": {"color": IO_COLORS[name], "width": width_px}, "xaxis": "x", "yaxis": "y"}


def _io_lanes(io: pd.DataFrame) -> list[str]:
    """Each I/O's lane name ("I/O lane k"), packed so overlapping I/Os get their own lanes."""
    return [f"I/O lane {k + 1}" for k in _lanes(io["start_ns"].to_numpy(), io["complete_ns"].to_numpy())]


def _within_a_pixel(lanes: list[str], start: np.ndarray, end: np.ndarray, gap: float
                    ) -> np.ndarray:
    """A group number per interval: the intervals of one lane that overlap or lie less than
    `gap` apart share one (each next to the reach of those before it in its lane)."""
    frame = pd.DataFrame({"lane": lanes, "start": start, "end": end}).sort_values(
        ["lane", "start"], kind="stable")
    reach = frame.groupby("lane")["end"].cummax().groupby(frame["lane"]).shift(1)
    starts = reach.isna() | (frame["start"] > reach + gap)
    return starts.cumsum().reindex(range(len(lanes))).to_numpy()


def _io_segments(io: pd.DataFrame, names: list[str], arrival_ns: int, width_px: float,
                 pixel_ms: float) -> list[dict]:
    """Queued and on-device parts of the I/Os, one trace each (empty ones too: the same traces
    for every request, so a redraw updates them instead of rebuilding the plot). I/Os of a lane
    less than `pixel_ms` apart are one segment: Plotly draws each segment as a path of its own,
    and a slow request's 1,776 I/Os were 3,552 paths, ~500 ms of its draw, most of them
    touching (bench/dashboard_render.py)."""
    what = [text(f"{op} {b // 1024} KiB tid {t}") for op, b, t in zip(io["op"], io["bytes"], io["tid"])]
    traces = []
    for name, start, end in (("I/O queued", "start_ns", "issue_ns"),
                             ("I/O on device", "issue_ns", "complete_ns")):
        parts = pd.DataFrame({"lane": names, "start": (io[start] - arrival_ns).to_numpy() / 1e6,
                              "end": (io[end] - arrival_ns).to_numpy() / 1e6,
                              "bytes": io["bytes"].to_numpy(), "what": what})
        parts["group"] = _within_a_pixel(names, parts["start"].to_numpy(), parts["end"].to_numpy(),
                                         pixel_ms)
        runs = parts.groupby("group", sort=False).agg(  # in the order of their first I/O
            lane=("lane", "first"), start=("start", "min"), end=("end", "max"),
            n=("start", "size"), bytes=("bytes", "sum"), what=("what", "first"))
        labels = [w if n == 1 else f"{n} I/Os, {b // 1024} KiB"
                  for w, n, b in zip(runs["what"], runs["n"], runs["bytes"])]
        hover = [f"{w}<br>start {s:.2f} ms<br>{e - s:.3f} ms"
                 for w, s, e in zip(labels, runs["start"], runs["end"])]
        traces.append(_segments(name, runs["lane"].tolist(), runs["start"].to_numpy(),
                                runs["end"].to_numpy(), hover, width_px))
    return traces


def _depth_in_window(depth: pd.DataFrame, start_ns: int, end_ns: int) -> pd.DataFrame:
    """Depth changes inside the window, plus the level carried in at its start."""
    depth = depth if depth["ts_ns"].is_monotonic_increasing else depth.sort_values("ts_ns", kind="stable")
    ts = depth["ts_ns"].to_numpy()
    lo, hi = np.searchsorted(ts, start_ns, "left"), np.searchsorted(ts, end_ns, "right")
    before = depth.iloc[max(lo - 1, 0):lo].assign(ts_ns=start_ns)
    return pd.concat([before, depth.iloc[lo:hi]], ignore_index=True)


def _depth_lane(depth: pd.DataFrame, start_ns: int, end_ns: int, bins: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """The in-flight depth over the window as (ns since its start, level): every change while
    they fit in `bins` points, else the peak per bin, a bin about a pixel wide. The slowest
    request of a study's run held 47k changes: 0.8 MB of its waterfall's JSON and ~100 ms of
    its draw, for more points than the lane has pixels (bench/dashboard_render.py)."""
    lane = _depth_in_window(depth, start_ns, end_ns)
    if len(lane) <= bins:
        return (lane["ts_ns"] - start_ns).to_numpy(), lane["inflight"].to_numpy()
    width = max((end_ns - start_ns) / bins, 1.0)
    n = int((end_ns - start_ns) // width) + 1
    return np.arange(n) * width, _binned_depth(lane, start_ns, width, n).to_numpy()


def build_waterfall_json(spans: pd.DataFrame, io: pd.DataFrame, depth: pd.DataFrame, *,
                         arrival_ns: int, first_token_ns: int, title: str,
                         bins: int = DEVICE_BINS) -> dict:
    """One request on one axis (ms since arrival): spans, block I/Os, device in-flight depth
    (at most `bins` points), as the figure's JSON (what the click callback sends;
    `build_waterfall` wraps it)."""
    _require(spans, ["name", "start_ns", "end_ns"], "the waterfall's spans")
    _require(io, ["start_ns", "issue_ns", "complete_ns", "bytes", "op", "tid"], "the waterfall's I/Os")
    _require(depth, ["ts_ns", "inflight"], "the waterfall's depth lane")
    if spans.empty and io.empty:
        return empty(f"{title}: no spans and no block I/Os recorded for this request").to_plotly_json()
    span_bars, span_lanes = _span_bars(spans, arrival_ns)
    io_names = _io_lanes(io) if not io.empty else []
    io_lanes = sorted(set(io_names), key=lambda s: int(s.rsplit(" ", 1)[1]))
    lanes = span_lanes + io_lanes
    height = max(WATERFALL_PX, LANE_PX * len(lanes) + 200)
    lane_px = (height - MARGIN_T - MARGIN_B) * (LANES_DOMAIN[1] - LANES_DOMAIN[0]) / len(lanes)
    end_ns = max([first_token_ns, *spans["end_ns"], *io["complete_ns"]])
    io_bars = _io_segments(io, io_names, arrival_ns, round(min(lane_px * 0.55, 40), 1),
                           (end_ns - arrival_ns) / 1e6 / PLOT_PX)
    since_ns, inflight = _depth_lane(depth, arrival_ns, end_ns, bins)
    depth_trace = {"type": "scatter", "x": (since_ns / 1e6).tolist(),
                   "y": inflight.tolist(), "mode": "lines", "line": {"shape": "hv",
                   "color": "#555555"}, "fill": "tozeroy", "name": "device in-flight",
                   "hovertemplate": "%{y} in flight at %{x:.2f} ms<extra></extra>",
                   "xaxis": "x2", "yaxis": "y2"}
    layout = {
        **style_json(), "title": {"text": title, "x": 0.01, "xanchor": "left"}, "barmode": "overlay",
        # no legend: the lanes name the spans (the page says which I/O colour is which), and a
        # legend pushes the margins, a second layout pass on every click
        "showlegend": False,
        "margin": {"l": LABEL_PX * max(FIXED_LABEL_CHARS, *map(len, lanes)) + 16, "r": 20,
                   "t": MARGIN_T, "b": MARGIN_B},
        "height": height,
        # ticklabeloverflow: the margins hold the labels; Plotly's check of every label's
        # box against the div's is a layout pass per axis on each redraw
        "xaxis": {"anchor": "y", "matches": "x2", "showticklabels": False, "domain": [0, 1],
                  "ticklabeloverflow": "allow"},
        "xaxis2": {"anchor": "y2", "title": {"text": "ms since arrival"}, "domain": [0, 1],
                   "ticklabeloverflow": "allow"},
        "yaxis": {"anchor": "x", "domain": LANES_DOMAIN, "categoryorder": "array",
                  "categoryarray": list(reversed(lanes)), "ticklabeloverflow": "allow"},
        "yaxis2": {"anchor": "x2", "domain": DEPTH_DOMAIN, "title": {"text": "in flight"},
                   "rangemode": "tozero", "ticklabeloverflow": "allow"},
    }
    if first_token_ns > 0:
        x = (first_token_ns - arrival_ns) / 1e6
        layout["shapes"] = [{"type": "line", "x0": x, "x1": x, "xref": "x", "y0": 0, "y1": 1,
                             "yref": "paper", "line": {"dash": "dot"}}]
        layout["annotations"] = [{"text": "first token", "x": x, "xref": "x", "y": 1,
                                  "yref": "paper", "showarrow": False, "yanchor": "bottom"}]
    return {"data": [span_bars, *io_bars, depth_trace], "layout": layout}


def build_waterfall(spans: pd.DataFrame, io: pd.DataFrame, depth: pd.DataFrame, *,
                    arrival_ns: int, first_token_ns: int, title: str) -> go.Figure:
    """`build_waterfall_json` as a go.Figure."""
    return go.Figure(build_waterfall_json(spans, io, depth, arrival_ns=arrival_ns,
                                          first_token_ns=first_token_ns, title=title))


def _bin_index(ts_ns: pd.Series, t0_ns: int, width_ns: float) -> pd.Series:
    return ((ts_ns - t0_ns) // width_ns).astype(int)


def _binned_depth(depth: pd.DataFrame, t0_ns: int, width_ns: float, bins: int) -> pd.Series:
    """Peak depth per bin: changes inside the bin and the level carried into it."""
    b = _bin_index(depth["ts_ns"], t0_ns, width_ns)
    per_bin = depth.groupby(b)["inflight"].agg(["max", "last"]).reindex(range(bins))
    carried = per_bin["last"].ffill().shift(1)
    return pd.Series(np.fmax(per_bin["max"], carried)).fillna(0)  # fmax: a bin without changes holds the level carried in


def _run_series(depth: pd.DataFrame, reads: pd.DataFrame, bins: int) -> pd.DataFrame:
    """Binned peak depth and read MB/s of one run, time in s since its first event."""
    t0 = int(np.concatenate([depth["ts_ns"], reads["start_ns"]]).min())
    t1 = int(np.concatenate([depth["ts_ns"], reads["complete_ns"]]).max())
    width = max((t1 - t0) / bins, 1e6)
    bins = int((t1 - t0) // width) + 1
    mbps = (reads.groupby(_bin_index(reads["complete_ns"], t0, width))["bytes"].sum()
            .reindex(range(bins), fill_value=0) / (width / 1e9) / 1e6)
    return pd.DataFrame({"t_s": np.arange(bins) * width / 1e9,
                         "depth": _binned_depth(depth, t0, width, bins).to_numpy(),
                         "read MB/s": mbps.to_numpy()})


def _per_run(frame: pd.DataFrame, columns: list[str]) -> Callable[[str], pd.DataFrame]:
    """A run's rows of `frame` (its `columns` only; none for a run it does not hold)."""
    parts = dict(tuple(frame.groupby("run", sort=False)[columns]))
    return lambda run: parts.get(run, frame[columns].iloc[:0])


def build_device(depth: pd.DataFrame, reads: pd.DataFrame, *, bins: int = DEVICE_BINS) -> go.Figure:
    """Device in-flight depth (peak per bin) and read bandwidth over time, runs overlaid."""
    _require(depth, ["run", "ts_ns", "inflight"], "the device depth view")
    _require(reads, ["run", "start_ns", "complete_ns", "bytes"], "the read bandwidth view")
    if depth.empty and reads.empty:
        return empty("no block I/O or queue depth recorded in the selected runs (probes off?)")
    layout = grid(2, 1, ["in-flight requests (peak per bin)", "read bandwidth"],
                  shared_xaxes=True, vertical_spacing=0.08)
    runs = list(dict.fromkeys([*depth["run"].unique(), *reads["run"].unique()]))
    colors = run_colors(runs)
    # Split once, on the columns drawn: a study's depth samples are millions of rows, and a
    # string comparison and a copy of every column per run took seconds of the app's start.
    depth_of = _per_run(depth, ["ts_ns", "inflight"])
    reads_of = _per_run(reads, ["start_ns", "complete_ns", "bytes"])
    data: list[dict[str, Any]] = []
    for run in runs:
        series = _run_series(depth_of(run), reads_of(run), bins)
        line = {"color": colors[run]}
        data += [{"type": "scatter", "x": series["t_s"].to_numpy(), "y": series["depth"].to_numpy(),
                  "name": text(run), "legendgroup": text(run), "line": {**line, "shape": "hv"},
                  **axes(0)},
                 {"type": "scatter", "x": series["t_s"].to_numpy(),
                  "y": series["read MB/s"].to_numpy(), "name": text(run), "legendgroup": text(run),
                  "showlegend": False, "line": line, **axes(1)}]
    layout["yaxis"].update(title={"text": "in flight"}, rangemode="tozero")
    layout["yaxis2"].update(title={"text": "MB/s"}, rangemode="tozero")
    layout["xaxis2"]["title"] = {"text": "s since the run's first I/O"}
    return figure(data, layout, "Device queue depth and read bandwidth")


def build_nvme(nvme_io: pd.DataFrame, *, bins: int = DEVICE_BINS) -> go.Figure:
    """Per hardware queue: commands in flight and peak command latency over time, per run."""
    _require(nvme_io, ["run", "qid", "setup_ns", "complete_ns"], "the NVMe queue view")
    io = nvme_io[nvme_io["qid"] > 0]
    if io.empty:
        return empty("no NVMe I/O commands recorded in the selected runs")
    frames = []
    for run, cmds in io.groupby("run", sort=False):
        t0 = cmds["setup_ns"].min()
        width = max((cmds["complete_ns"].max() - t0) / bins, 1e6)
        for qid, q in cmds.groupby("qid"):
            events = pd.DataFrame({"ts_ns": np.concatenate([q["setup_ns"], q["complete_ns"]]),
                                   "step": np.repeat([1, -1], len(q))}).sort_values("ts_ns")
            events["inflight"] = events["step"].cumsum()
            n = int((cmds["complete_ns"].max() - t0) // width) + 1
            latency = (q.assign(ms=(q["complete_ns"] - q["setup_ns"]) / 1e6)
                       .groupby(_bin_index(q["complete_ns"], t0, width))["ms"].max().reindex(range(n)))
            frames.append(pd.DataFrame({
                "run": text(run), "qid": f"q{qid}", "t_s": np.arange(n) * width / 1e9,
                "in flight": _binned_depth(events, t0, width, n).to_numpy(),
                "peak latency ms": latency.to_numpy()}))
    long = pd.concat(frames).melt(id_vars=["run", "qid", "t_s"], var_name="metric")
    fig = px.line(long, x="t_s", y="value", color="qid", facet_row="metric", facet_col="run",
                  line_shape="hv", labels={"t_s": "s since the run's first command"})
    fig.update_yaxes(matches=None, rangemode="tozero", title_text="")
    fig.for_each_trace(lambda t: t.update(mode="markers", marker_size=4),
                       selector=lambda t: "latency" in (t.hovertemplate or ""))
    return style(fig, "NVMe hardware queues")
