"""The dashboard in real headless Chromium (dash[testing]): few tests, each checks a lot."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from kvscope.dashboards import ids
from kvscope.dashboards.app import create_app

pytestmark = pytest.mark.browser


def graph_text(dash_duo, graph_id: str) -> str:
    return dash_duo.find_element(f"#{graph_id}").text


def open_tab(dash_duo, label: str, graph_id: str) -> None:
    """Open the views' tab of this label and wait until its graph `graph_id` has drawn."""
    next(t for t in dash_duo.find_elements(f"#{ids.VIEW_TABS} .tab") if t.text == label).click()
    dash_duo.wait_for_element(f"#{graph_id} .main-svg", timeout=60)


def test_two_runs_side_by_side_every_view_and_no_console_errors(dash_duo, synthetic_runs):
    dash_duo.start_server(create_app(synthetic_runs, jaeger_url="http://127.0.0.1:16686"))
    dash_duo.wait_for_element(f"#{ids.BREAKDOWN_GRAPH} .bars path", timeout=20)
    dash_duo.wait_for_contains_text(f"#{ids.WATERFALL_GRAPH} .gtitle", "TTFT", timeout=20)
    breakdown = graph_text(dash_duo, ids.BREAKDOWN_GRAPH)
    assert "serial" in breakdown and "parallel" in breakdown  # one panel per run
    assert "storage_read" in breakdown  # the legend of components
    bars = dash_duo.find_elements(f"#{ids.BREAKDOWN_GRAPH} .bars path")
    assert len(bars) == 6 * 36  # 6 components x (12 + 24) cold requests: the default view
    dash_duo.wait_for_contains_text(f"#{ids.PERCENTILE_GRAPH}", "p99", timeout=20)  # open tab
    for closed in (ids.THROUGHPUT_GRAPH, ids.CONCURRENCY_GRAPH, ids.CHUNK_REASONS_GRAPH,
                   ids.DEVICE_GRAPH, ids.NVME_GRAPH):
        assert not dash_duo.find_elements(f"#{closed}")  # not drawn until its tab opens
    open_tab(dash_duo, "Mean breakdown per concurrency", ids.CONCURRENCY_GRAPH)
    assert "c=4" in graph_text(dash_duo, ids.CONCURRENCY_GRAPH)  # its level, numeric order
    assert not dash_duo.find_elements(f"#{ids.PERCENTILE_GRAPH}")  # one tab drawn at a time
    open_tab(dash_duo, "Storage device", ids.NVME_GRAPH)
    assert "in-flight requests" in graph_text(dash_duo, ids.DEVICE_GRAPH)
    assert "q1" in graph_text(dash_duo, ids.NVME_GRAPH)
    selected = dash_duo.find_element(f"#{ids.REQUEST}").text  # `run · phase · id · ms`
    assert selected.split(" · ")[2] in graph_text(dash_duo, ids.WATERFALL_GRAPH)
    link = dash_duo.find_element(f"#{ids.JAEGER_LINK} a").get_attribute("href")
    assert link.startswith("http://127.0.0.1:16686/trace/") and len(link.rsplit("/", 1)[1]) == 32
    # the chunk ledger of the cold phases: tally per run, reasons over time, the request's strip
    open_tab(dash_duo, "Chunks", ids.CHUNK_REASONS_GRAPH)
    dash_duo.wait_for_contains_text(f"#{ids.CHUNK_TABLE}", "hit: disk", timeout=20)
    tally = dash_duo.find_element(f"#{ids.CHUNK_TABLE}").text
    assert "serial" in tally and "parallel" in tally and "miss: " in tally
    reasons = graph_text(dash_duo, ids.CHUNK_REASONS_GRAPH)
    assert "s since the run's first lookup" in reasons and "hit: disk" in reasons
    dash_duo.wait_for_contains_text(f"#{ids.CHUNK_STRIP_GRAPH} .gtitle", selected.split(" · ")[2],
                                    timeout=20)
    assert dash_duo.find_elements(f"#{ids.CHUNK_STRIP_GRAPH} .bars path")
    assert dash_duo.get_logs() == []


WATERFALL_FETCHES_JS = """return performance.getEntriesByType('resource')
    .filter(e => e.name.includes('/_kvscope/waterfall')).length;"""


def test_clicking_a_request_bar_updates_its_waterfall(dash_duo, synthetic_runs):
    dash_duo.start_server(create_app(synthetic_runs[:1]))
    dash_duo.wait_for_contains_text(f"#{ids.WATERFALL_GRAPH} .gtitle", "TTFT", timeout=20)
    before = dash_duo.find_element(f"#{ids.WATERFALL_GRAPH} .gtitle").text
    driver = dash_duo.driver
    loaded = driver.execute_script(WATERFALL_FETCHES_JS)  # the slowest request's, at page load
    bars = dash_duo.find_elements(f"#{ids.BREAKDOWN_GRAPH} .bars path")
    ActionChains(driver).move_to_element(bars[len(bars) // 2 - 1]).perform()
    # the pointer rests on a request: its waterfall is fetched before any click
    dash_duo._wait_for(lambda d: d.execute_script(WATERFALL_FETCHES_JS) == loaded + 1,
                       timeout=20, msg="resting on a request did not fetch its waterfall")
    driver.execute_script(f"""window.drawn = 0; document.querySelector(
        '#{ids.WATERFALL_GRAPH} .js-plotly-plot').on('plotly_afterplot', () => window.drawn++);""")
    ActionChains(driver).click().perform()
    title = f"#{ids.WATERFALL_GRAPH} .gtitle"
    dash_duo._wait_for(lambda d: d.find_element(By.CSS_SELECTOR, title).text != before,
                       timeout=20, msg="the waterfall did not follow the click")
    clicked = dash_duo.find_element(title).text.split(": TTFT")[0].split(" · ")[2]
    assert clicked not in before
    dash_duo.wait_for_contains_text(f"#{ids.REQUEST}", clicked, timeout=20)  # the dropdown follows
    dash_duo.wait_for_contains_text(f"#{ids.REQUEST_DETAILS}", "TTFT", timeout=20)
    assert driver.execute_script(WATERFALL_FETCHES_JS) == loaded + 1  # drawn from the fetched one
    assert driver.execute_script("return window.drawn;") == 1  # once: not again by Dash's chain
    # its block I/Os are drawn as line segments (one path each), not as bars
    io_traces = driver.execute_script(f"""
        const gd = document.querySelector('#{ids.WATERFALL_GRAPH} .js-plotly-plot');
        return gd.data.filter(t => t.name.startsWith('I/O')).map(t => t.type + ' ' + t.mode);""")
    assert io_traces == ["scatter lines", "scatter lines"]
    assert dash_duo.find_elements(f"#{ids.WATERFALL_GRAPH} .scatterlayer path.js-line")
    assert dash_duo.get_logs() == []


def test_the_page_opens_on_the_cold_phases_and_warm_is_one_click_away(dash_duo, synthetic_runs):
    dash_duo.start_server(create_app(synthetic_runs))
    dash_duo.wait_for_element(f"#{ids.BREAKDOWN_GRAPH} .bars path", timeout=60)
    dash_duo.wait_for_contains_text(f"#{ids.PERCENTILE_GRAPH}", "ttft", timeout=20)
    checked = dash_duo.find_element(f"#{ids.PHASE} input:checked").get_attribute("value")
    assert checked == "cold*"
    percentiles = graph_text(dash_duo, ids.PERCENTILE_GRAPH)
    for component in ("ttft", "storage_read", "prefill", "queueing"):
        assert component in percentiles  # one panel each
    assert "warm" not in percentiles
    open_tab(dash_duo, "Throughput", ids.THROUGHPUT_GRAPH)
    assert "requests/s" in graph_text(dash_duo, ids.THROUGHPUT_GRAPH)
    open_tab(dash_duo, "Mean breakdown per concurrency", ids.CONCURRENCY_GRAPH)
    assert "warm" not in graph_text(dash_duo, ids.CONCURRENCY_GRAPH)
    assert "cold" in dash_duo.find_element(f"#{ids.REQUEST}").text  # a cold request's waterfall
    assert len(dash_duo.find_elements(f"#{ids.BREAKDOWN_GRAPH} .bars path")) == 6 * 36
    warm = next(e for e in dash_duo.find_elements(f"#{ids.PHASE} label") if e.text == "warm")
    warm.click()
    dash_duo._wait_for(lambda d: len(d.find_elements(
        By.CSS_SELECTOR, f"#{ids.BREAKDOWN_GRAPH} .bars path")) == 6 * 12, timeout=20,
        msg="the warm phase did not show")
    dash_duo.wait_for_contains_text(f"#{ids.CONCURRENCY_GRAPH}", "serial · warm", timeout=20)
    assert "parallel" not in graph_text(dash_duo, ids.CONCURRENCY_GRAPH)  # it has no warm phase
    assert dash_duo.get_logs() == []


PROFILES = ("kvscope", "kvscope-serial", "kvscope-classic", "stock", "raw-block-posix",
            "raw-block-io_uring", "fs")  # the seven of the study (/work/studies/s0602a)
LEVELS = {"cold-c16": 16, "cold-c1": 1, "cold-c8": 8}  # run in this order: 16 first


@pytest.fixture(scope="module")
def study_profiles(tmp_path_factory: pytest.TempPathFactory) -> list:
    """Seven synthetic runs (the study's profiles), each with cold phases at concurrency 16, 1
    and 8 (in that order, so neither run order nor string order is numeric order)."""
    import pandas as pd

    from kvscope.testkit import synthetic

    root = tmp_path_factory.mktemp("profiles")
    runs = []
    for i, name in enumerate(PROFILES):
        run = synthetic.make_run(root / name, n_requests=18, seed=20 + i, concurrency=3,
                                 phases=tuple(LEVELS), ledger=True)
        requests = pd.read_parquet(run / "requests.parquet")
        requests["concurrency"] = requests["phase"].map(LEVELS).astype(requests["concurrency"].dtype)
        requests.to_parquet(run / "requests.parquet", index=False)
        runs.append(run)
    return runs


# Every text a figure draws (ticks, axis and panel titles, legend, title), as page rectangles.
TEXT_BOXES_JS = """
const root = document.getElementById(arguments[0]);
return [...root.querySelectorAll('.xaxislayer-above text, .yaxislayer-above text, .g-xtitle text,'
                                 + ' .g-ytitle text, .annotation-text, .legendtext, .gtitle')]
    .filter(t => t.textContent.trim())
    .map(t => { const r = t.getBoundingClientRect();
                return [t.textContent, r.left, r.top, r.right, r.bottom]; })
    .filter(b => b[3] > b[1] && b[4] > b[2]);
"""
# Per x axis of a figure: its tick labels from left to right (axis n's ticks are `xntick`).
TICKS_JS = """
const root = document.getElementById(arguments[0]);
return [...root.querySelectorAll('.xaxislayer-above')].map(layer =>
    [...layer.querySelectorAll('text')]
        .map(t => [t.getBoundingClientRect().left, t.textContent])
        .sort((a, b) => a[0] - b[0]).map(t => t[1]));
"""


def overlaps(boxes: list) -> list[tuple[str, str]]:
    hits = []
    for i, (a, *ra) in enumerate(boxes):
        for b, *rb in boxes[i + 1:]:
            if ra[0] < rb[2] - 1 and rb[0] < ra[2] - 1 and ra[1] < rb[3] - 1 and rb[1] < ra[3] - 1:
                hits.append((a, b))
    return hits


def test_study_profiles_stay_readable(dash_duo, study_profiles, tmp_path):
    """The study's seven profiles side by side: the breakdown, percentile, per-concurrency and
    throughput views draw no label over another and put concurrency in numeric order (1, 8,
    16), one colour per run."""
    dash_duo.driver.set_window_size(1500, 1000)
    dash_duo.start_server(create_app(study_profiles))
    # seven runs' views drawn by software-rendering Chromium on a shared 2-core machine: slow
    dash_duo.wait_for_contains_text(f"#{ids.WATERFALL_GRAPH} .gtitle", "TTFT", timeout=90)
    dash_duo.wait_for_element(f"#{ids.PERCENTILE_GRAPH} .xtick text", timeout=90)
    driver = dash_duo.driver
    dash_duo.wait_for_element(f"#{ids.BREAKDOWN_GRAPH} .annotation-text", timeout=90)
    breakdown = driver.execute_script(TEXT_BOXES_JS, ids.BREAKDOWN_GRAPH)  # one block per run
    assert {name for name, *_ in breakdown} >= set(PROFILES) and overlaps(breakdown) == []
    percentiles = graph_text(dash_duo, ids.PERCENTILE_GRAPH)
    for name in PROFILES:
        assert name in percentiles  # the legend: one entry per run
    views = {  # graph -> its tab, the tick labels of each of its panels
        ids.PERCENTILE_GRAPH: ("Percentiles per component", [["1", "8", "16"]] * 7),
        ids.CONCURRENCY_GRAPH: ("Mean breakdown per concurrency", [["c=1", "c=8", "c=16"]] * len(PROFILES)),
        ids.THROUGHPUT_GRAPH: ("Throughput", [["cold-c1 c=1", "cold-c8 c=8", "cold-c16 c=16"]] * 3),
    }
    for graph, (tab, ticks) in views.items():
        open_tab(dash_duo, tab, graph)
        dash_duo.wait_for_element(f"#{graph} .xtick text", timeout=90)
        boxes = driver.execute_script(TEXT_BOXES_JS, graph)
        assert len(boxes) > 10, graph
        assert overlaps(boxes) == [], graph
        # one panel per component (the grid's spare cell empty) / per run / per metric
        assert [t for t in driver.execute_script(TICKS_JS, graph) if t] == ticks, graph
        driver.save_screenshot(str(tmp_path / f"profiles-{graph}.png"))
    assert dash_duo.get_logs() == []
