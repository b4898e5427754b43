"""Issue 19: every string a run brings reaches the page as text, never as markup.

A request id is whatever the client sent as X-Request-Id; span names, phases and run directory
names come from files another host or user may have written. Plotly renders a subset of HTML
(links included) in titles, labels and hover text, so each such string must arrive escaped.
The run here is a synthetic one whose strings were replaced by markup, loaded as the dashboard
loads any run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest

from kvscope.dashboards import callbacks, chunk_callbacks, data
from kvscope.dashboards.app import create_app
from kvscope.testkit import synthetic

LINK = '<a href="https://evil.example/">click</a>'
VICTIM = "cold-0000001"


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic run whose request id VICTIM is LINK, in its table and in its spans."""
    root = tmp_path_factory.mktemp("hostile")
    run = synthetic.make_run(root / "made", n_requests=6, seed=3, concurrency=2, ledger=True)
    requests = pd.read_parquet(run / "requests.parquet")
    requests["request_id"] = requests["request_id"].replace(VICTIM, LINK)
    requests.to_parquet(run / "requests.parquet", index=False)
    for path in (run / "spans").glob("*.json"):
        path.write_text(path.read_text().replace(f'"{VICTIM}"', json.dumps(LINK)))
    return Path(shutil.move(run, root / "run"))


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _figure_json(figure) -> dict:
    return figure if isinstance(figure, dict) else go.Figure(figure).to_plotly_json()


def test_a_client_chosen_request_id_is_text_in_every_figure(hostile_run):
    runs = data.load_runs([hostile_run])
    label = next(iter(runs))
    key = data.request_key(label, "cold", LINK)
    figures = [callbacks.waterfall_of(runs, key),
               callbacks.update_breakdown(runs, [label], None, "TTFT"),
               *callbacks.update_summary_views(runs, [label], None)[:3],
               chunk_callbacks.update_chunk_strip(runs, key),
               chunk_callbacks.update_chunk_views(runs, [label], None)[1]]
    shown = [s for figure in figures for s in _strings(_figure_json(figure)) if s != key]
    assert not [s for s in shown if "<a " in s], "markup from the run reached a figure"
    title = callbacks.waterfall_of(runs, key)["layout"]["title"]["text"]
    assert "&lt;a href=" in title and "click&lt;/a&gt;" in title


def test_the_served_waterfall_title_is_escaped(hostile_run):
    client = create_app([hostile_run]).server.test_client()
    label = next(iter(data.load_runs([hostile_run])))
    answer = client.get(callbacks.WATERFALL_ROUTE,
                        query_string={"key": data.request_key(label, "cold", LINK)})
    assert answer.status_code == 200
    assert "&lt;a href" in answer.get_json()["layout"]["title"]["text"]
    assert not [s for s in _strings(answer.get_json()) if "<a " in s]
