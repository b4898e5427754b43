"""Callbacks as plain functions and the served app, on synthetic runs, without a browser."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest
import plotly.graph_objects as go

from kvscope.dashboards import callbacks, data, ids
from kvscope.dashboards.app import create_app


def labels(loaded: dict) -> list[str]:
    return list(loaded)


def test_ttft_views_show_every_selected_run(loaded):
    breakdown = callbacks.update_breakdown(loaded, labels(loaded), None, "TTFT")
    concurrency, percentiles, rates, findings = callbacks.update_summary_views(
        loaded, labels(loaded), None)
    assert {a.text for a in breakdown.layout.annotations} == {"serial", "parallel"}
    shown = sum(len(t.x) for t in breakdown.data if t.name == "prefill")
    assert shown == sum(len(rd.attribution) for rd in loaded.values())
    assert {a.text for a in concurrency.layout.annotations} == {"serial · warm", "serial",
                                                                "parallel"}
    assert {x for t in concurrency.data for x in t.x} == {"c=1", "c=4"}
    assert {x for t in percentiles.data for x in t.x} == {1, 4}
    assert {t.name for t in percentiles.data} == {"serial · warm", "serial", "parallel"}
    assert {t.line.dash for t in percentiles.data} == {"solid", "dash"}  # p50, p99
    panels = {a.text for a in percentiles.layout.annotations}
    assert panels == {"ttft", "queueing", "kv_lookup", "storage_read", "transfer", "prefill",
                      "other"}  # one component per panel
    assert {a.text for a in rates.layout.annotations} == {
        "requests/s", "prompt tokens/s from storage", "output tokens/s"}
    requests_per_s = {(t.name, x): y for t in rates.data for x, y in zip(t.x, t.y)
                      if t.xaxis == "x"}
    serial_cold = next(r for r in loaded["serial"].summary["throughput"] if r["phase"] == "cold")
    assert requests_per_s[("serial", "cold c=1")] == pytest.approx(serial_cold["requests_per_s"])
    assert findings.children  # a table, or the sentence saying there are none


def test_the_default_view_is_the_cold_phases_and_warm_is_one_choice_away(loaded):
    assert data.default_phase(loaded) == data.COLD
    cold = data.attribution_of(loaded, labels(loaded), data.COLD)
    assert set(cold["phase"]) == {"cold"} and len(cold) == sum(
        (rd.attribution["phase"] == "cold").sum() for rd in loaded.values())
    _, percentiles, rates, _ = callbacks.update_summary_views(loaded, labels(loaded), data.COLD)
    assert {(t.name, x) for t in percentiles.data for x in t.x} == {("serial", 1),
                                                                    ("parallel", 4)}
    assert {x for t in rates.data for x in t.x} == {"cold c=1", "cold c=4"}
    options, value = callbacks.update_request_options(loaded, labels(loaded), data.COLD, None, None)
    assert json.loads(value)[1] == "cold"
    assert set(data.attribution_of(loaded, ["serial"], "warm")["phase"]) == {"warm"}
    assert len(data.attribution_of(loaded, labels(loaded), data.ALL)) == len(
        data.attribution_of(loaded, labels(loaded), None))


def test_phase_filter_limits_the_requests(loaded):
    breakdown = callbacks.update_breakdown(loaded, ["serial"], "warm", "arrival")
    keys = {json.loads(c[0])[1] for t in breakdown.data if t.customdata is not None
            for c in t.customdata}
    assert keys == {"warm"}


def test_request_choices_slowest_first_and_a_click_selects(loaded):
    options, first = callbacks.update_request_options(loaded, labels(loaded), None, None, None)
    assert first == options[0]["value"]
    slowest = max(rd.attribution["ttft_ns"].max() for rd in loaded.values())
    assert f"{slowest / 1e6:.1f} ms" in options[0]["label"]
    kept = options[5]["value"]
    assert callbacks.update_request_options(loaded, labels(loaded), None, None, kept)[1] == kept
    rid = json.loads(kept)[2]
    found, still = callbacks.update_request_options(loaded, labels(loaded), None, rid, kept)
    assert still == kept and all(rid in o["label"] for o in found)


def test_request_waterfall_holds_that_requests_spans(loaded):
    key = loaded["parallel"].attribution["key"].iloc[3]
    view = data.request_of(loaded, key)
    fig = callbacks.waterfall_of(loaded, key)
    link, details = callbacks.update_request_details(loaded, key, "http://jaeger:16686/")
    fig = go.Figure(fig)  # plain figure JSON on the click path; plotly validates it here
    assert {"queue", "storage.read", "prefill"} <= set(fig.data[0].y)  # the spans' lanes
    assert "device in-flight" in {t.name for t in fig.data}
    bars = sum(len(t.x) for t in fig.data if t.type == "bar")
    assert bars == len(view.spans)
    assert link.href == f"http://jaeger:16686/trace/{view.trace_id}"
    assert "TTFT" in details.children[0].children


@pytest.mark.parametrize(("url", "trace_id", "expect"), [
    pytest.param(None, "a" * 32, "--jaeger-url", id="not-configured"),
    pytest.param("http://j", "", "no trace id", id="tracing-off"),
    pytest.param("http://j", "<script>", "no trace id", id="not-hex"),
])
def test_jaeger_link_only_for_a_real_trace(url, trace_id, expect):
    assert expect in callbacks.jaeger_link(url, trace_id).children


def test_download_sends_the_shown_table_as_csv(loaded):
    sent = callbacks.download(loaded, "attribution", ["serial"], "cold", None)
    frame = pd.read_csv(io.StringIO(sent["content"]))
    assert set(frame["phase"]) == {"cold"} and set(frame["run"]) == {"serial"}
    assert len(frame) == (loaded["serial"].attribution["phase"] == "cold").sum()
    with pytest.raises(ValueError, match="unknown table"):
        callbacks.download(loaded, "../../etc/passwd", ["serial"], None, None)


def test_device_and_nvme_views(loaded):
    device = callbacks.update_device(loaded, labels(loaded))
    assert {t.name for t in device.data if t.showlegend is not False} == {"serial", "parallel"}
    nvme = callbacks.update_nvme(loaded, ["parallel"])
    assert any(t.name.startswith("q") for t in nvme.data)
    assert "none of the selected runs" in callbacks.update_nvme(loaded, ["serial"]).layout.annotations[0].text


def test_served_app_lays_out_every_view_and_serves_no_files(synthetic_runs):
    client = create_app(synthetic_runs).server.test_client()
    layout = client.get("/_dash-layout").get_data(as_text=True)
    for component in (ids.BREAKDOWN_GRAPH, ids.WATERFALL_GRAPH, ids.DEVICE_GRAPH, ids.NVME_GRAPH,
                      ids.FINDINGS, ids.DOWNLOAD):
        assert f'"{component}"' in layout
    manifest = (synthetic_runs[0] / "manifest.json").read_text()[:40]
    for path in ("/assets/../data.py", "/assets/%2e%2e/data.py", "/_dash-component-suites/../app.py",
                 f"/{synthetic_runs[0]}/manifest.json", "/_dash-layout/../../etc/passwd"):
        body = client.get(path).get_data(as_text=True)
        assert "def load_runs" not in body and "def create_app" not in body
        assert manifest not in body and "root:x:0:0" not in body


def test_waterfall_route_serves_a_loaded_requests_figure_and_nothing_else(synthetic_runs, loaded):
    client = create_app(synthetic_runs).server.test_client()
    key = loaded["parallel"].attribution["key"].iloc[3]
    answer = client.get(callbacks.WATERFALL_ROUTE, query_string={"key": key})
    assert answer.status_code == 200 and answer.mimetype == "application/json"
    fig = answer.get_json()
    assert json.loads(key)[2] in fig["layout"]["title"]["text"]
    assert fig == json.loads(callbacks.serve_waterfall(loaded, key).get_data())  # the same figure
    unselected = client.get(callbacks.WATERFALL_ROUTE).get_json()
    assert "no request selected" in unselected["layout"]["annotations"][0]["text"]
    for bad, status in [("../../etc/passwd", 400), ('["x"]', 400), ("[1, 2, 3]", 400),
                        ("[" * 100_000, 400), ('["a", "b", "' + "c" * 5000 + '"]', 400),
                        ('["parallel", "cold", "no-such-request"]', 404),
                        (json.dumps(["nope", "cold", "r1"]), 404)]:
        answer = client.get(callbacks.WATERFALL_ROUTE, query_string={"key": bad})
        assert answer.status_code == status, bad[:40]
        assert "root:x:0:0" not in answer.get_data(as_text=True)


def test_unreadable_run_is_a_clear_error(tmp_path):
    with pytest.raises(data.DashboardError, match=str(tmp_path / "missing")):
        create_app([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DashboardError, match="empty"):
        create_app([tmp_path / "empty"])


def test_the_browser_script_uses_the_ids_and_route_the_app_serves():
    from kvscope.dashboards.app import ASSETS

    script = (ASSETS / "waterfall.js").read_text()  # it cannot import ids.py
    assert f"BREAKDOWN = '{ids.BREAKDOWN_GRAPH}', WATERFALL = '{ids.WATERFALL_GRAPH}'" in script
    assert f"REQUEST = '{ids.REQUEST}'" in script
    assert f"'{callbacks.WATERFALL_ROUTE.lstrip('/')}?key='" in script
