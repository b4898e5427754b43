"""Figure builders on small hand-made frames: what each figure plots, not how it looks."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from kvscope.dashboards import figures, timeline

COMPONENT_NS = {"queueing_ns": 1e6, "kv_lookup_ns": 2e6, "storage_read_ns": 30e6,
                "transfer_ns": 4e6, "prefill_ns": 5e6, "other_ns": 1e6}


def attribution(run: str, n: int, *, scale: float = 1.0) -> pd.DataFrame:
    """n requests whose components grow with the index (request i is the i-th slowest + 1)."""
    rows = []
    for i in range(n):
        parts = {k: int(v * (i + 1) * scale) for k, v in COMPONENT_NS.items()}
        rows.append({"run": run, "request_id": f"r{i}", "phase": "cold",
                     "concurrency": 1 + i % 2, "arrival_ns": 10_000 * i,
                     "key": json.dumps([run, "cold", f"r{i}"]),
                     "ttft_ns": sum(parts.values()), **parts})
    return pd.DataFrame(rows)


def stacked_totals(fig) -> dict[tuple[str, int], float]:
    totals: dict[tuple[str, int], float] = {}
    for trace in fig.data:
        for x, y in zip(trace.x, trace.y):
            axis = trace.xaxis or "x"
            totals[(axis, x)] = totals.get((axis, x), 0.0) + y
    return totals


def test_breakdown_bars_stack_to_ttft_slowest_first():
    frame = attribution("serial", 5)
    fig = figures.build_breakdown(frame, sort_by="TTFT")
    assert {t.type for t in fig.data} == {"bar"}
    assert [t.name for t in fig.data] == list(figures.COMPONENTS)
    totals = stacked_totals(fig)
    expected = sorted(frame["ttft_ns"] / 1e6, reverse=True)
    assert [totals[("x", rank)] for rank in range(5)] == pytest.approx(expected)
    assert fig.data[0].customdata[0][0] == frame["key"].iloc[-1]  # rank 0 is the slowest


def test_breakdown_sorted_by_arrival_keeps_arrival_order():
    frame = attribution("serial", 4).sample(frac=1, random_state=3)
    fig = figures.build_breakdown(frame, sort_by="arrival")
    keys = [c[0] for c in fig.data[0].customdata]
    assert keys == list(frame.sort_values("arrival_ns")["key"])


def test_breakdown_puts_runs_side_by_side_as_blocks_of_one_panel():
    """One pair of axes whatever the runs (each axis is a layout pass in the browser): each
    run a block of its requests, a gap before the next, its name above its block."""
    frame = pd.concat([attribution("serial", 3), attribution("parallel", 3, scale=0.5)])
    fig = figures.build_breakdown(frame)
    assert {t.xaxis or "x" for t in fig.data} == {"x"} and "xaxis2" not in fig.layout
    assert len(fig.data) == len(figures.COMPONENTS)  # one bar trace per component
    keys = [c[0] for c in fig.data[0].customdata]
    blocks = dict(zip(keys, fig.data[0].x))
    serial = [blocks[k] for k in frame["key"].iloc[:3]]
    parallel = [blocks[k] for k in frame["key"].iloc[3:]]
    assert sorted(serial) == [0, 1, 2] and sorted(parallel) == [4, 5, 6]  # a gap of one
    assert [(a.text, a.x) for a in fig.layout.annotations] == [("serial", 1), ("parallel", 5)]
    assert all(t.marker.line.width == 0 for t in fig.data)  # no outline to style per bar


def test_breakdown_above_its_points_draws_the_largest_request_of_each_bin_of_ranks():
    """30 requests in 10 points: a stacked step area through one real request per 3 ranks,
    the slowest of each (its parts still sum to its TTFT, its key is what a click opens)."""
    frame = attribution("big", 30)
    fig = figures.build_breakdown(frame, max_points=10)
    assert {t.type for t in fig.data} == {"scatter"}
    assert {t.stackgroup for t in fig.data} == {"1"}
    # by TTFT: each bin's first rank, and the last step closed at the run's end
    assert list(fig.data[0].x) == [*range(0, 30, 3), 30]
    keys = [c[0] for c in fig.data[0].customdata]
    slowest_first = frame.sort_values("ttft_ns", ascending=False)["key"].tolist()
    assert keys == [*slowest_first[::3], slowest_first[27]]
    totals = stacked_totals(fig)
    ttft = frame.set_index("key")["ttft_ns"] / 1e6
    assert [totals[("x", x)] for x in fig.data[0].x] == pytest.approx(ttft[keys].tolist())
    assert "each the largest TTFT of its bin" in fig.layout.title.text


def test_breakdown_by_arrival_keeps_each_bins_slowest_spike():
    """Sorted by arrival, a bin is drawn as its slowest request: a spike stays in the picture
    where every other request is fast."""
    frame = attribution("big", 40, scale=0.01).sample(frac=1, random_state=5)
    frame = frame.assign(arrival_ns=range(len(frame)))
    spike = frame.index[17]  # arrival rank 17: bin 4 of 10 (ranks 16-19)
    frame.loc[spike, ["storage_read_ns", "ttft_ns"]] += 10**9
    fig = figures.build_breakdown(frame, sort_by="arrival", max_points=10)
    assert list(fig.data[0].x)[4] == 17
    read = next(t for t in fig.data if t.name == "storage_read")
    assert max(read.y) == pytest.approx(frame.loc[spike, "storage_read_ns"] / 1e6)


def test_breakdown_shares_its_points_among_the_runs():
    frame = pd.concat([attribution(run, 150) for run in ("a", "b", "c")])
    fig = figures.build_breakdown(frame, max_points=300)  # 100 a run: each binned
    areas = [t for t in fig.data if t.name == "queueing"]  # one per run: no stack bridges two
    assert [len(t.x) for t in areas] == [101, 101, 101]  # and each last step's end
    assert max(areas[0].x) < min(areas[1].x) and max(areas[1].x) < min(areas[2].x)
    every = figures.build_breakdown(frame, max_points=450)  # 150 a run: every request
    assert [len(t.x) for t in every.data if t.name == "queueing"] == [151, 151, 151]


def test_breakdown_draws_a_bar_per_request_while_bars_are_wide_else_step_areas():
    """Bars while each is a few pixels wide; past BAR_LIMIT requests a bar is a sliver and a
    path per component to style, so each run is a stacked step area through every request."""
    half = figures.BAR_LIMIT // 2
    bars = figures.build_breakdown(pd.concat([attribution(run, half) for run in "ab"]))
    assert {t.type for t in bars.data} == {"bar"} and len(bars.data) == len(figures.COMPONENTS)
    areas = figures.build_breakdown(pd.concat([attribution(run, half + 1) for run in "ab"]))
    assert {(t.type, t.line.shape) for t in areas.data} == {("scatter", "hv")}
    assert [t.stackgroup for t in areas.data if t.name == "prefill"] == ["1", "2"]  # per run
    first, second = (t for t in areas.data if t.name == "prefill")
    assert list(first.x) == list(range(half + 2))  # each request a step, the last to its end
    start = second.x[0]
    assert start > half + 1 and list(second.x) == list(range(start, start + half + 2))  # a gap
    assert "drawn" not in areas.layout.title.text  # every request: none binned


def test_breakdown_is_clicked_in_the_browser_and_not_drag_zoomed_by_default():
    """A click selects the request its unified hover shows (assets/waterfall.js): Plotly emits
    no click (its hover recompute and Dash's clickData would come before the waterfall) and a
    drag draws no zoom box (it repaints the areas before the next frame)."""
    for requests in (10, 30):
        fig = figures.build_breakdown(attribution("big", requests), max_points=20)
        assert fig.layout.hovermode == "x unified"
        assert fig.layout.clickmode == "none" and fig.layout.dragmode is False
        assert fig.data[0].customdata is not None  # the key the hover carries


def test_breakdown_rejects_unknown_sort_and_missing_columns():
    with pytest.raises(ValueError, match="not one of"):
        figures.build_breakdown(attribution("a", 2), sort_by="colour")
    with pytest.raises(ValueError, match="prefill_ns"):
        figures.build_breakdown(attribution("a", 2).drop(columns="prefill_ns"))


def test_trace_strings_are_shown_as_text_not_markup():
    frame = attribution("<i>run</i>", 2).assign(request_id="<b onmouseover=x>r</b>")
    fig = figures.build_breakdown(frame)
    hover = fig.data[0].customdata[0]
    assert "&lt;b onmouseover=x&gt;r&lt;/b&gt;" in list(hover)
    assert fig.layout.annotations[0].text == "&lt;i&gt;run&lt;/i&gt;"


def test_concurrency_bars_are_means_per_level():
    frame = attribution("serial", 4)  # levels 1: r0, r2 ; 2: r1, r3
    fig = figures.build_concurrency(frame)
    storage = next(t for t in fig.data if t.name == "storage_read")
    assert dict(zip(storage.x, storage.y)) == pytest.approx({"c=1": 60.0, "c=2": 90.0})


def six_profiles(levels=(16, 1, 8)) -> pd.DataFrame:
    """Six runs' cold phases at `levels` (given out of order), one warm phase for the first."""
    frames = []
    for r, run in enumerate(("kvscope", "kvscope-serial", "stock", "raw-block-posix",
                             "raw-block-io_uring", "fs")):
        for c in levels:
            part = attribution(run, 4, scale=1 + r + c / 16).assign(
                phase=f"cold-c{c}", concurrency=c)
            frames.append(part.assign(key=part["key"] + f"-{c}"))
    warm = attribution("kvscope", 2).assign(phase="warm", concurrency=1)
    return pd.concat([warm, *frames], ignore_index=True)


def test_concurrency_is_one_panel_per_run_levels_in_numeric_order_one_shared_scale():
    fig = figures.build_concurrency(six_profiles())
    panels = [a.text for a in fig.layout.annotations]
    assert panels == ["kvscope · warm", "kvscope", "kvscope-serial", "stock", "raw-block-posix",
                      "raw-block-io_uring", "fs"]
    for trace in fig.data:
        if trace.xaxis != "x":  # the warm panel has its one level
            assert list(trace.x) == ["c=1", "c=8", "c=16"]  # numbers, not strings, in order
    assert len({fig.layout[a].matches for a in fig.layout if a.startswith("yaxis")} - {None}) == 1
    assert sum(t.showlegend is not False for t in fig.data) == len(figures.COMPONENTS)


def percentile_rows(frame: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (run, phase, c), group in frame.groupby(["run", "phase", "concurrency"], sort=False):
        for component in figures.PANEL_COMPONENTS:
            values = group[f"{component}_ns"].to_numpy("float64")
            rows += [{"run": run, "series": f"{run} · {phase} c={c}", "phase": phase,
                      "concurrency": c, "component": component, "percentile": name,
                      "value_ns": float(np.percentile(values, q))}
                     for name, q in (("p50", 50), ("p90", 90), ("p99", 99))]
    return pd.DataFrame(rows)


def test_percentiles_one_panel_per_component_runs_as_colours_concurrency_numeric():
    frame = six_profiles()
    pct = percentile_rows(frame)
    fig = figures.build_percentiles(pct)
    assert [a.text for a in fig.layout.annotations] == list(figures.PANEL_COMPONENTS)
    assert {t.name for t in fig.data} == {"kvscope · warm", "kvscope", "kvscope-serial", "stock",
                                          "raw-block-posix", "raw-block-io_uring", "fs"}
    assert sum(bool(t.showlegend) for t in fig.data) == 7  # one entry per line, not per panel
    colors = {t.name: t.line.color for t in fig.data}
    assert len(set(colors.values())) == 6 and colors["kvscope"] == colors["kvscope · warm"]
    for axis in (a for a in fig.layout if a.startswith("xaxis")):
        assert fig.layout[axis].type == "log" and list(fig.layout[axis].tickvals) == [1, 8, 16]
        low, high = fig.layout[axis].range  # log10: every level inside, off the edges
        assert low < 0 < np.log10(16) < high
        assert fig.layout[axis].tickangle is None  # nothing rotated into the next row
    stock_p99 = next(t for t in fig.data if t.name == "stock" and t.line.dash == "dash"
                     and t.xaxis == "x4")  # storage_read, the fourth panel
    assert list(stock_p99.x) == [1, 8, 16]
    expected = pct[(pct["run"] == "stock") & (pct["component"] == "storage_read")
                   & (pct["percentile"] == "p99")].sort_values("concurrency")
    assert list(stock_p99.y) == pytest.approx((expected["value_ns"] / 1e6).round(3).tolist())
    assert all(fig.layout[a].matches is None for a in fig.layout if a.startswith("yaxis"))
    # a line without markers (each one an SVG node to style); a point of its own has one
    assert {t.mode for t in fig.data if len(t.x) > 1} == {"lines"}
    warm = [t for t in fig.data if t.name == "kvscope · warm"]
    assert {(t.mode, t.marker.symbol) for t in warm} == {("markers", "diamond-open")}
    sub_parts = pct.assign(component="storage_device_queue")
    assert len(figures.build_percentiles(pd.concat([pct, sub_parts])).data) == len(fig.data)


def test_empty_selection_says_why():
    fig = figures.build_breakdown(attribution("a", 1).iloc[0:0])
    assert "no requests" in fig.layout.annotations[0].text


def waterfall_inputs():
    arrival = 1_000_000_000
    spans = pd.DataFrame({
        "name": ["kvscope.client.request", "kvscope.queue", "kvscope.storage.read",
                 "kvscope.storage.read", "kvscope.prefill"],
        "start_ns": [arrival, arrival, arrival + 2_000_000, arrival + 9_000_000, arrival + 12e6],
        "end_ns": [arrival + 20e6, arrival + 2e6, arrival + 8e6, arrival + 11e6, arrival + 19e6],
    })
    io = pd.DataFrame({"start_ns": [arrival + 3e6, arrival + 3.5e6, arrival + 7e6],
                       "issue_ns": [arrival + 3.2e6, arrival + 3.6e6, arrival + 7.1e6],
                       "complete_ns": [arrival + 5e6, arrival + 6e6, arrival + 7.9e6],
                       "bytes": [262144] * 3, "op": ["R"] * 3, "tid": [11, 12, 11]})
    depth = pd.DataFrame({"ts_ns": [arrival - 5e6, arrival + 3.2e6, arrival + 5e6],
                          "inflight": [1, 2, 1]})
    return spans, io, depth, arrival


def test_waterfall_puts_spans_and_ios_on_ms_since_arrival():
    spans, io, depth, arrival = waterfall_inputs()
    fig = timeline.build_waterfall(spans, io, depth, arrival_ns=arrival,
                                   first_token_ns=arrival + 20_000_000, title="r1")
    bars = fig.data[0]  # every span, one trace: a bar per span, coloured by its name
    assert list(bars.y) == ["queue", "client.request", "storage.read", "storage.read #2", "prefill"]
    assert list(bars.base) == pytest.approx([0.0, 0.0, 2.0, 9.0, 12.0])
    assert list(bars.x) == pytest.approx([2.0, 20.0, 6.0, 2.0, 7.0])
    assert bars.marker.color[2] == bars.marker.color[3] == timeline.SPAN_COLORS["storage.read"]
    device = next(t for t in fig.data if t.name == "I/O on device")  # segments: start, end, gap
    assert list(device.y) == ["I/O lane 1"] * 2 + [None] + ["I/O lane 2"] * 2 + [None] + [
        "I/O lane 1"] * 2 + [None]  # overlap -> own lane
    assert list(device.x) == pytest.approx([3.2, 5.0, None, 3.6, 6.0, None, 7.1, 7.9, None])
    assert device.mode == "lines" and "1.800 ms" in device.hovertext[0]
    lane = next(t for t in fig.data if t.name == "device in-flight")
    assert list(lane.x) == pytest.approx([0.0, 3.2, 5.0])
    assert list(lane.y) == [1, 2, 1]  # the level carried in at arrival comes first


def test_waterfall_depth_lane_is_thinned_to_its_peaks():
    """A busy device changes depth more often than the lane has pixels: past `bins` changes the
    lane is the peak per bin, so a one-change spike stays visible."""
    spans, io, _, arrival = waterfall_inputs()
    ts = arrival + np.arange(10_000) * 2_000  # a change every 2 us over the 20 ms request
    inflight = np.where(np.arange(10_000) == 7_777, 64, np.arange(10_000) % 3)
    depth = pd.DataFrame({"ts_ns": ts, "inflight": inflight})
    fig = timeline.build_waterfall_json(spans, io, depth, arrival_ns=arrival,
                             first_token_ns=arrival + 20_000_000, title="busy", bins=100)
    lane = fig["data"][-1]
    assert len(lane["x"]) <= 101 and set(lane["y"][:-1]) == {2, 64}  # each bin's peak
    assert lane["y"][-1] == 0  # past the last change (0): the level it left
    assert lane["x"][0] == 0.0 and lane["x"][-1] <= 20.0 and lane["x"] == sorted(lane["x"])


def test_waterfall_json_is_slim_and_sizes_its_own_margins():
    """What a click sends: no per-trace template defaults, no automargin and no legend (each a
    second layout pass on every redraw), so the left margin must fit the longest lane label."""
    spans, io, depth, arrival = waterfall_inputs()
    layout = timeline.build_waterfall_json(spans, io, depth, arrival_ns=arrival,
                                first_token_ns=arrival + 20_000_000, title="r1")["layout"]
    assert set(layout["template"]) == {"layout"} and layout["showlegend"] is False
    axes = [layout["template"]["layout"][a] for a in ("xaxis", "yaxis")]
    axes += [layout[a] for a in ("xaxis", "yaxis", "xaxis2", "yaxis2")]
    assert not any(axis.get("automargin") for axis in axes)
    longest = max(map(len, layout["yaxis"]["categoryarray"]))  # "storage.read #2"
    assert longest == 15 and layout["margin"]["l"] >= timeline.LABEL_PX * longest


def test_waterfall_has_one_size_and_the_same_traces_for_every_request():
    """Another height or margin is a whole replot, and dcc.Graph redraws once more when its div
    changes size: two requests with different lanes get one figure size and trace list."""
    spans, io, depth, arrival = waterfall_inputs()
    few = timeline.build_waterfall_json(spans.iloc[:2], io.iloc[:0], depth, arrival_ns=arrival,
                             first_token_ns=arrival + 20_000_000, title="few")
    many = timeline.build_waterfall_json(spans, io, depth, arrival_ns=arrival,
                              first_token_ns=arrival + 20_000_000, title="many")
    assert len(few["layout"]["yaxis"]["categoryarray"]) == 2
    assert len(many["layout"]["yaxis"]["categoryarray"]) == 7  # 5 span lanes, 2 I/O lanes
    for key in ("height", "margin"):
        assert few["layout"][key] == many["layout"][key]
    assert [t["name"] for t in few["data"]] == [t["name"] for t in many["data"]] == [
        "spans", "I/O queued", "I/O on device", "device in-flight"]  # I/O traces drawn empty
    tall_io = pd.concat([io] * 10, ignore_index=True)  # 20 I/Os overlap: 20 lanes
    tall = timeline.build_waterfall_json(spans, tall_io, depth, arrival_ns=arrival,
                              first_token_ns=arrival + 20_000_000, title="tall")
    lanes = len(tall["layout"]["yaxis"]["categoryarray"])
    assert lanes > timeline.FIXED_LANES and tall["layout"]["height"] >= timeline.LANE_PX * lanes


def test_waterfall_shows_span_names_as_text():
    spans, io, depth, arrival = waterfall_inputs()
    spans.loc[1, "name"] = "<img src=x onerror=alert(1)>"
    fig = timeline.build_waterfall(spans, io, depth, arrival_ns=arrival,
                                   first_token_ns=arrival + 20_000_000, title="r1")
    assert "&lt;img src=x onerror=alert(1)&gt;" in fig.data[0].y


def test_lanes_pack_overlapping_intervals():
    lanes = timeline._lanes(np.array([0, 1, 2, 5]), np.array([3, 4, 6, 7]))
    assert list(lanes) == [0, 1, 2, 0]


def test_device_view_bandwidth_and_peak_depth():
    reads = pd.DataFrame({"run": "a", "start_ns": np.arange(10) * 100_000_000,
                          "complete_ns": np.arange(10) * 100_000_000 + 50_000_000,
                          "bytes": 1_000_000})
    depth = pd.DataFrame({"run": "a", "ts_ns": [0, 10_000_000, 20_000_000, 990_000_000],
                          "inflight": [1, 4, 1, 0]})
    fig = timeline.build_device(depth, reads, bins=10)
    depth_trace, mbps = fig.data
    assert max(depth_trace.y) == 4
    width_s = mbps.x[1] - mbps.x[0]
    assert sum(mbps.y) * width_s == pytest.approx(10.0)  # 10 MB over the run


def test_nvme_view_has_a_line_per_queue_and_metric():
    nvme = pd.DataFrame({"run": "a", "qid": [0, 1, 1, 2], "setup_ns": [0, 0, 1e6, 5e5],
                         "complete_ns": [1e5, 2e6, 3e6, 9e5]})
    fig = timeline.build_nvme(nvme, bins=4)
    assert {t.name for t in fig.data} == {"q1", "q2"}  # the admin queue (0) is left out
    assert len(fig.data) == 4
