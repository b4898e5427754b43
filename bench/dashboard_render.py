"""Dashboard render benchmark and screenshot tool, in real headless Chromium.

  python bench/dashboard_render.py                      # 10k-request synthetic run: timings
  python bench/dashboard_render.py --baseline 069fcfe   # ... side by side with that revision
  python bench/dashboard_render.py --requests 2000      # a smaller synthetic run
  python bench/dashboard_render.py --screenshot docs/img/dashboard.png runs/serial runs/parallel
  python bench/dashboard_render.py --screenshot out.png --tab Throughput runs/serial runs/parallel

Timings: app load (from the runs' analysis outputs, as after `kvscope analyze`, next to a copy
of the runs without them, analysed at start), first render (navigation until every graph has
drawn its data and the waterfall shows the slowest request), opening each tab of the views
that compare runs (a click until its graphs have drawn: the browser draws only the open tab),
and a click on a request (pointer already over it, hover settled: click until the waterfall
shows the clicked request, seen from webdriver and in the page), next to the server's part
called in-process. With --baseline REV the same page measurements run on
`kvscope dashboard` of that revision (from `git archive`, in its own server and browser; a
revision with the kvscope/<room> links, ddf5cf3 or later), alternating with this tree's, so
both see the same machine load; the synthetic run is then
written by that revision's generator, so both read it as the baseline wrote it; and both trees'
app load from the analysis outputs runs in a fresh interpreter each, alternating.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from kvscope.dashboards import callbacks, data, ids
from kvscope.dashboards.app import build_app
from kvscope.dashboards.browser import chromium_options

PORT = 8077  # this tree's app; the baseline's is PORT + 1
GRAPHS = 4  # breakdown, the open tab's (percentiles), waterfall, chunk strip (>= 4 drawn)
# True once every graph on the page has drawn its data (or, for a view with nothing to show,
# such as the chunk section of a run without a chunk ledger, the note saying why) and the
# waterfall names a request.
RENDERED_JS = f"""
const graphs = [...document.querySelectorAll('.js-plotly-plot')];
const title = document.querySelector('#{ids.WATERFALL_GRAPH} .gtitle');
return graphs.length >= {GRAPHS} && graphs.every(g => g._fullLayout && (
        (g.data && g.data.length > 0) || (g.layout.annotations || []).length > 0))
    && title !== null && title.textContent.includes('TTFT');
"""
# The views' tabs (pages/views.py) by label, in page order; none on a revision without them.
TABS_JS = f"return [...document.querySelectorAll('#{ids.VIEW_TABS} .tab')].map(t => t.textContent);"
OPEN_TAB_JS = f"""
[...document.querySelectorAll('#{ids.VIEW_TABS} .tab')].find(t => t.textContent === arguments[0]).click();
"""
# True once the tab labelled arguments[0] is open and every graph in it has drawn.
TAB_DRAWN_JS = f"""
const open = document.querySelector('#{ids.VIEW_TABS} .tab--selected');
const graphs = [...document.querySelectorAll('#{ids.VIEW_TABS}-parent .tab-content [id$="-graph"]')]
    .map(g => g.querySelector('.js-plotly-plot'));
return open !== null && open.textContent === arguments[0] && graphs.length > 0
    && graphs.every(g => g !== null && g._fullLayout && (
        (g.data && g.data.length > 0) || (g.layout.annotations || []).length > 0));
"""
TITLE_CHANGED_JS = f"""
const title = document.querySelector('#{ids.WATERFALL_GRAPH} .gtitle');
return title !== null && title.textContent !== arguments[0];
"""
TITLE_JS = f"return document.querySelector('#{ids.WATERFALL_GRAPH} .gtitle').textContent;"
# In the page: the click's mousedown and the first animation frame after the waterfall shows
# another request (what the eye sees), without webdriver's round trips in between.
WATCH_CLICK_JS = f"""
const before = arguments[0], graph = document.getElementById('{ids.WATERFALL_GRAPH}');
const seen = window.kvscopeBench = {{}};
document.addEventListener('mousedown', e => {{ seen.down = e.timeStamp; }}, {{capture: true, once: true}});
const watch = new MutationObserver(() => {{
    const title = graph.querySelector('.gtitle');
    if (title && title.textContent !== before) {{
        watch.disconnect();
        requestAnimationFrame(() => {{ seen.frame = performance.now(); }});
    }}
}});
watch.observe(graph, {{subtree: true, childList: true, characterData: true}});
"""
IN_PAGE_JS = "const s = window.kvscopeBench; return s.frame === undefined ? null : (s.frame - s.down) / 1000;"
HOVER_SETTLE_S = 0.5  # after pointing at a request, before the click: its hover has drawn


@dataclass
class Page:
    """One app under test, in its own headless Chromium (a background tab would be throttled)."""

    name: str
    url: str
    driver: Any


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


def extract(rev: str, root: Path) -> Path:
    """The tree of git revision `rev` (from `git archive`, the working tree untouched)."""
    tree = root / "baseline"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _in_tree(tree: Path) -> dict[str, str]:
    """The environment that imports kvscope from `tree` instead of this checkout."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def serve_revision(rev: str, tree: Path, runs: list[Path], root: Path) -> tuple[subprocess.Popen, str]:
    """`kvscope dashboard` of revision `rev`, extracted at `tree`, on PORT + 1."""
    url = f"http://127.0.0.1:{PORT + 1}/"
    log = root / "baseline.log"  # a file, not a pipe: werkzeug logs every request
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvscope.cli", "dashboard", *map(str, runs), "--port", str(PORT + 1)],
            cwd=tree, env=_in_tree(tree), stdout=out, stderr=out)
    deadline = time.monotonic() + 300  # it may analyse the runs at start
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{rev}'s dashboard exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{rev}'s dashboard did not answer on {url} in 300 s")


def first_render(page: Page) -> float:
    """Seconds from navigation until every view has drawn."""
    start = time.perf_counter()
    page.driver.get(page.url)
    wait_until(page.driver, RENDERED_JS)
    return time.perf_counter() - start


def open_tabs(page: Page) -> dict[str, float]:
    """Seconds from a click on each tab (the first last, from the one before it) until its
    graphs have drawn; empty for a page without the tabs."""
    labels = page.driver.execute_script(TABS_JS)
    took = {}
    for label in [*labels[1:], *labels[:1]]:
        start = time.perf_counter()
        page.driver.execute_script(OPEN_TAB_JS, label)
        wait_until(page.driver, TAB_DRAWN_JS, label)
        took[label] = time.perf_counter() - start
    return took


def click(page: Page, fraction: float) -> tuple[float, float]:
    """Point at the request `fraction` along the breakdown plot, let its hover draw, then
    click: seconds until the waterfall shows another request, seen from webdriver (a poll every
    10 ms, each a script the page runs when its main thread is free) and in the page (mousedown
    until the first frame after the waterfall changed)."""
    from selenium.webdriver.common.action_chains import ActionChains

    area = page.driver.find_element("css selector", f"#{ids.BREAKDOWN_GRAPH} .nsewdrag")
    before = page.driver.execute_script(TITLE_JS)
    # selenium 4.2: offsets from the element's top-left corner; duration 0: no 250 ms glide
    ActionChains(page.driver, duration=0).move_to_element_with_offset(
        area, int(area.size["width"] * fraction), area.size["height"] // 2).perform()
    time.sleep(HOVER_SETTLE_S)
    page.driver.execute_script(WATCH_CLICK_JS, before)
    start = time.perf_counter()
    ActionChains(page.driver, duration=0).click().perform()
    wait_until(page.driver, TITLE_CHANGED_JS, before, timeout_s=30)
    seen = time.perf_counter() - start
    wait_until(page.driver, IN_PAGE_JS, timeout_s=5)
    return seen, page.driver.execute_script(IN_PAGE_JS)


def in_process_callback(app_runs, keys: list[str]) -> list[float]:
    """What the server does for a request's waterfall (data selection, figure, JSON), no browser."""
    out = []
    for key in keys:
        start = time.perf_counter()
        callbacks.serve_waterfall(app_runs, key)
        out.append(time.perf_counter() - start)
    return out


def screenshot(driver, url: str, out: Path, width: int, tab: str | None) -> None:
    """The whole page, every view drawn (with the tab labelled `tab` open), as one PNG."""
    driver.get(url)
    wait_until(driver, RENDERED_JS)
    if tab:
        driver.execute_script(OPEN_TAB_JS, tab)
        wait_until(driver, TAB_DRAWN_JS, tab)
    height = driver.execute_script("return document.documentElement.scrollHeight;")
    driver.set_window_size(width, height)
    wait_until(driver, RENDERED_JS)
    time.sleep(1.0)  # plotly redraws on resize; there is no event to wait on from outside
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))
    print(f"screenshot: {out} ({width}x{height})")


# The baseline's own generator writes the run it is shown (a newer tree may write a later
# schema); this tree reads that run too (older schemas stay readable) and analyses its copy.
GENERATE = """
import sys
from kvscope.analysis import outputs
from kvscope.testkit import synthetic
run = synthetic.make_run(sys.argv[1], n_requests=int(sys.argv[2]), seed=7, concurrency=8)
outputs.analyze(run, plots=False)
"""


def synthetic(requests: int, root: Path, baseline: Path | None) -> tuple[list[Path], list[Path]]:
    """A synthetic run, analysed as `kvscope analyze` (or the demo) leaves it, for this tree and
    for the baseline tree (written by the baseline's generator when there is one)."""
    from kvscope.analysis import outputs
    from kvscope.testkit import synthetic as synth

    if baseline is None:
        run = synth.make_run(root / "synthetic", n_requests=requests, seed=7, concurrency=8)
        outputs.analyze(run, plots=False)
        return [run], [run]
    theirs = root / "baseline-run" / "synthetic"
    subprocess.run([sys.executable, "-c", GENERATE, str(theirs), str(requests)], cwd=baseline,
                   env=_in_tree(baseline), check=True)
    ours = Path(shutil.copytree(theirs, root / "synthetic"))
    outputs.analyze(ours, plots=False)
    return [ours], [theirs]


def timed_load(runs: list[Path]) -> tuple[float, dict[str, data.RunData]]:
    """Seconds to load the runs and lay out the app, and the loaded runs."""
    start = time.perf_counter()
    loaded = data.load_runs(runs)
    build_app(loaded)
    return time.perf_counter() - start, loaded


# A fresh interpreter's app load, as `kvscope dashboard` starts: the imports, then the runs
# loaded from their analysis outputs and the opening page built (printed as two numbers).
FRESH_LOAD = """
import sys, time
start = time.perf_counter()
from kvscope.dashboards import data
from kvscope.dashboards.app import build_app
imported = time.perf_counter()
build_app(data.load_runs(sys.argv[1:]))
print(imported - start, time.perf_counter() - imported)
"""


def fresh_load(tree: Path, runs: list[Path]) -> tuple[float, float]:
    """Seconds to import the app, then to load `runs` and build the page, in a new interpreter
    importing kvscope from `tree`."""
    out = subprocess.run([sys.executable, "-c", FRESH_LOAD, *map(str, runs)], cwd=tree,
                         env=_in_tree(tree), check=True, capture_output=True, text=True).stdout
    imports, load = out.split()[-2:]
    return float(imports), float(load)


def without_outputs(runs: list[Path], root: Path) -> list[Path]:
    """Copies of the runs without their analysis outputs: what the app analyses at start."""
    from kvscope.analysis import outputs

    skip = shutil.ignore_patterns(outputs.ATTRIBUTION_FILE, outputs.SUMMARY_FILE, outputs.SPANS_FILE)
    return [Path(shutil.copytree(run, root / "no-outputs" / f"{i}" / run.name, ignore=skip))
            for i, run in enumerate(runs)]


def _median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} ms"


def _median_s(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s"


def _side_by_side(what: str, times: dict[str, list[float]], fmt=_median_ms) -> None:
    """One line: the median per page, and this tree's over the baseline's when there is one."""
    cells = [f"{name} {fmt(t)}" for name, t in times.items()]
    ratio = ""
    if len(times) == 2:
        ours, base = (statistics.median(t) for t in times.values())
        ratio = f" ({ours / base:.2f}x)"
    print(f"{what}: {', '.join(cells)}{ratio}")


def bench(args: argparse.Namespace, runs: list[Path], baseline_runs: list[Path],
          tree: Path | None, root: Path) -> None:
    """Print app load, first render and click latencies for `runs`, beside the baseline's (the
    revision extracted at `tree`, showing `baseline_runs`)."""
    from selenium import webdriver

    from kvscope.analysis import outputs

    if not all(outputs.load_current(r) is not None for r in runs):
        print("note: the runs' analysis outputs are missing or stale; run `kvscope analyze` first")
    load_s, loaded = timed_load(runs)
    analysing_s, _ = timed_load(without_outputs(runs, root))
    n = sum(len(rd.attribution) for rd in loaded.values())
    print(f"runs: {', '.join(map(str, runs))} ({n} requests)")
    print(f"app load (+ layout): from the analysis outputs {load_s:.2f} s, analysing at start "
          f"{analysing_s:.2f} s ({load_s / analysing_s:.2f}x)")
    trees = {"this tree": (REPO, runs), **({args.baseline: (tree, baseline_runs)} if tree else {})}
    imports: dict[str, list[float]] = {name: [] for name in trees}
    loads: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.repeat):
        for name, (where, shown) in trees.items():
            took = fresh_load(where, shown)
            imports[name].append(took[0])
            loads[name].append(took[1])
    _side_by_side(f"app load in a fresh interpreter (runs from their analysis outputs + the "
                  f"opening page), median of {args.repeat}", loads, _median_s)
    _side_by_side("  before it, importing the app", imports, _median_s)
    runner, url = serve(build_app(loaded))
    servers = [("this tree", url)]
    baseline = None
    if tree:
        baseline, base_url = serve_revision(args.baseline, tree, baseline_runs, root)
        servers.append((args.baseline, base_url))
    pages = [Page(name, u, webdriver.Chrome(options=chromium_options(args.width, 1000)))
             for name, u in servers]
    try:
        for page in pages:
            first_render(page)  # Chromium's own first start and cache warm-up
        renders: dict[str, list[float]] = {p.name: [] for p in pages}
        for _ in range(args.repeat):
            for page in pages:
                renders[page.name].append(first_render(page))
        tabs: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            for label, took in open_tabs(pages[0]).items():
                tabs.setdefault(label, []).append(took)
        clicks: dict[str, list[float]] = {p.name: [] for p in pages}
        in_page: dict[str, list[float]] = {p.name: [] for p in pages}
        for i in range(args.clicks):  # rank 0 is already shown
            for page in pages:
                seen, drawn = click(page, 0.2 + 0.75 * i / max(args.clicks - 1, 1))
                clicks[page.name].append(seen)
                in_page[page.name].append(drawn)
        errors = {p.name: len([e for e in p.driver.get_log("browser") if e["level"] == "SEVERE"])
                  for p in pages}
    finally:
        for page in pages:
            page.driver.quit()
        runner.stop()
        if baseline:
            baseline.terminate()
            baseline.wait(timeout=30)
    keys = list(next(iter(loaded.values())).attribution["key"].sample(args.clicks, random_state=1))
    _side_by_side(f"first render (navigation -> every view drawn), median of {args.repeat}",
                  renders, _median_s)
    for label, took in tabs.items():
        print(f"  this tree: open the tab {label!r} -> its graphs drawn, median of "
              f"{args.repeat}: {_median_ms(took)}")
    _side_by_side(f"click on a request -> its waterfall drawn (webdriver), median of {args.clicks}",
                  clicks)
    _side_by_side("  in the page: mousedown -> first frame with its waterfall", in_page)
    print(f"  this tree's server work for a waterfall in-process (select + figure + JSON), "
          f"median: {_median_ms(in_process_callback(loaded, keys))}")
    print("browser console errors: " + ", ".join(f"{k} {v}" for k, v in errors.items()))


def shoot(args: argparse.Namespace, runs: list[Path]) -> None:
    from selenium import webdriver

    runner, url = serve(build_app(data.load_runs(runs)))
    driver = webdriver.Chrome(options=chromium_options(args.width, 1000))
    try:
        screenshot(driver, url, args.screenshot, args.width, args.tab)
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
    parser.add_argument("--baseline", metavar="REV",
                        help="also measure this git revision's dashboard, alternating with this tree's")
    parser.add_argument("--screenshot", type=Path, help="save a full-page PNG here instead")
    parser.add_argument("--tab", help="with --screenshot: open the views' tab of this label first")
    parser.add_argument("--width", type=int, default=1500, help="browser width in px")
    parser.add_argument("--repeat", type=int, default=5, help="first renders to time")
    parser.add_argument("--clicks", type=int, default=8, help="request selections to time")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tree = extract(args.baseline, root) if args.baseline and not args.screenshot else None
        runs, baseline_runs = ((args.runs, args.runs) if args.runs
                               else synthetic(args.requests, root, tree))
        try:
            if args.screenshot:
                shoot(args, runs)
            else:
                bench(args, runs, baseline_runs, tree, root)
        except data.DashboardError as e:
            print(f"dashboard_render: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
