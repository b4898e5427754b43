"""Dashboard render benchmark and screenshot tool, in real headless Chromium.

  python bench/dashboard_render.py                      # 10k-request synthetic run: timings
  python bench/dashboard_render.py --requests 2000      # a smaller synthetic run
  python bench/dashboard_render.py --screenshot docs/img/dashboard.png runs/serial runs/parallel

Timings: app load (from the runs' analysis outputs, as after `kvscope analyze`; and without
them, analysing at start), first render (navigation until every graph has
drawn its data and the waterfall shows the slowest request), and request-selection latency
(a click on the breakdown plot until the waterfall shows the clicked request), the latter next
to the same callback called in-process, so the gap is transport + drawing.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboards import callbacks, data, ids  # noqa: E402
from dashboards.app import build_app  # noqa: E402
from dashboards.browser import chromium_options  # noqa: E402

PORT = 8077
GRAPHS = 4  # breakdown, concurrency, percentiles, waterfall, device (>= 4 drawn)
# True once every graph on the page has drawn data and the waterfall names a request.
RENDERED_JS = f"""
const graphs = [...document.querySelectorAll('.js-plotly-plot')];
const title = document.querySelector('#{ids.WATERFALL_GRAPH} .gtitle');
return graphs.length >= {GRAPHS} && graphs.every(g => g.data && g.data.length > 0)
    && title !== null && title.textContent.includes('TTFT');
"""
TITLE_CHANGED_JS = f"""
const title = document.querySelector('#{ids.WATERFALL_GRAPH} .gtitle');
return title !== null && title.textContent !== arguments[0];
"""
TITLE_JS = f"return document.querySelector('#{ids.WATERFALL_GRAPH} .gtitle').textContent;"


def wait_until(driver, script: str, *args, timeout_s: float = 60.0) -> float:
    """Seconds until `script` returns a truthy value in the page (polled every 10 ms)."""
    start = time.perf_counter()
    while not driver.execute_script(script, *args):
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"the page did not get there in {timeout_s} s: {script.strip()[:90]}")
        time.sleep(0.01)
    return time.perf_counter() - start


def serve(app):
    """The app on 127.0.0.1:PORT in a thread (dash's own test runner), and its URL."""
    from dash.testing.application_runners import ThreadedRunner

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    runner = ThreadedRunner()
    runner.start(app, port=PORT)
    return runner, f"http://127.0.0.1:{PORT}/"


def first_render(driver, url: str) -> float:
    """Seconds from navigation until every view has drawn."""
    start = time.perf_counter()
    driver.get(url)
    wait_until(driver, RENDERED_JS)
    return time.perf_counter() - start


def click_latencies(driver, clicks: int) -> list[float]:
    """Click along the breakdown plot; seconds until the waterfall shows another request."""
    from selenium.webdriver.common.action_chains import ActionChains

    area = driver.find_element("css selector", f"#{ids.BREAKDOWN_GRAPH} .nsewdrag")
    width, height = area.size["width"], area.size["height"]
    out = []
    for i in range(clicks):  # selenium 4.2: offsets from the element's top-left corner
        before = driver.execute_script(TITLE_JS)
        x = int(width * (0.2 + 0.75 * i / max(clicks - 1, 1)))  # rank 0 is already shown
        start = time.perf_counter()
        ActionChains(driver).move_to_element_with_offset(area, x, height // 2).click().perform()
        wait_until(driver, TITLE_CHANGED_JS, before, timeout_s=30)
        out.append(time.perf_counter() - start)
    return out


def in_process_callback(app_runs, keys: list[str]) -> list[float]:
    """The request-selection callback alone (data selection + figure), no browser."""
    out = []
    for key in keys:
        start = time.perf_counter()
        callbacks.update_request(app_runs, key, None)
        out.append(time.perf_counter() - start)
    return out


def screenshot(driver, url: str, out: Path, width: int) -> None:
    """The whole page, every view drawn, as one PNG."""
    driver.get(url)
    wait_until(driver, RENDERED_JS)
    height = driver.execute_script("return document.documentElement.scrollHeight;")
    driver.set_window_size(width, height)
    wait_until(driver, RENDERED_JS)
    time.sleep(1.0)  # plotly redraws on resize; there is no event to wait on from outside
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))
    print(f"screenshot: {out} ({width}x{height})")


def synthetic(requests: int, root: Path) -> list[Path]:
    """A synthetic run, analysed as `kvscope analyze` (or the demo) leaves it."""
    from analysis import outputs
    from analysis import synthetic as synth

    run = synth.make_run(root / "synthetic", n_requests=requests, seed=7, concurrency=8)
    outputs.analyze(run, plots=False)
    return [run]


def bench(args: argparse.Namespace, runs: list[Path]) -> None:
    """Print app load, first render and request-selection latencies for `runs`."""
    from selenium import webdriver

    from analysis import outputs

    current = all(outputs.load_current(r) is not None for r in runs)
    start = time.perf_counter()
    loaded = data.load_runs(runs)
    app = build_app(loaded)
    load_s = time.perf_counter() - start
    n = sum(len(rd.attribution) for rd in loaded.values())
    print(f"runs: {', '.join(map(str, runs))} ({n} requests)")
    print(f"app load ({'from the analysis outputs' if current else 'analysing at start: no current outputs'}"
          f" + layout): {load_s:.2f} s")
    runner, url = serve(app)
    driver = webdriver.Chrome(options=chromium_options(args.width, 1000))
    try:
        first_render(driver, url)  # Chromium's own first start and cache warm-up
        renders = [first_render(driver, url) for _ in range(args.repeat)]
        clicks = click_latencies(driver, args.clicks)
        logs = driver.get_log("browser")
    finally:
        driver.quit()
        runner.stop()
    keys = list(next(iter(loaded.values())).attribution["key"].sample(args.clicks, random_state=1))
    calls = in_process_callback(loaded, keys)
    print(f"first render (navigation -> every view drawn), median of {args.repeat}: "
          f"{statistics.median(renders):.2f} s (target <= 2 s; all: "
          f"{', '.join(f'{r:.2f}' for r in renders)})")
    print(f"request selection (click -> waterfall redrawn), median of {len(clicks)}: "
          f"{statistics.median(clicks) * 1000:.0f} ms")
    print(f"  of which the callback in-process (select + build figure), median: "
          f"{statistics.median(calls) * 1000:.0f} ms "
          f"(ratio browser/in-process {statistics.median(clicks) / statistics.median(calls):.1f}x)")
    print(f"browser console errors: {len([e for e in logs if e['level'] == 'SEVERE'])}")


def shoot(args: argparse.Namespace, runs: list[Path]) -> None:
    from selenium import webdriver

    runner, url = serve(build_app(data.load_runs(runs)))
    driver = webdriver.Chrome(options=chromium_options(args.width, 1000))
    try:
        screenshot(driver, url, args.screenshot, args.width)
    finally:
        driver.quit()
        runner.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n")[1])
    parser.add_argument("runs", nargs="*", type=Path,
                        help="run directories (default: a synthetic run of --requests)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--screenshot", type=Path, help="save a full-page PNG here instead")
    parser.add_argument("--width", type=int, default=1500, help="browser width in px")
    parser.add_argument("--repeat", type=int, default=5, help="first renders to time")
    parser.add_argument("--clicks", type=int, default=8, help="request selections to time")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs or synthetic(args.requests, Path(tmp))
        try:
            (shoot if args.screenshot else bench)(args, runs)
        except data.DashboardError as e:
            print(f"dashboard_render: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
