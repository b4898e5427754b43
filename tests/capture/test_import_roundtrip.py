"""A real run's spans through the forms trace backends store them, back with `kvscope import`:
the same attribution, the same chunk ledger and the same phases as the original, request by
request.

The run (data/live-tiny-kvscope, README there) is `kvscope run --model tiny --profile kvscope`
with a warm phase and cold phases at concurrency 1 and 3, traced, its chunk ledger included.
Its spans go out as `kvscope export otlp` writes them, into each backend form (Jaeger's written
by testkit.jaeger_forms from Jaeger's own conversion rules), and come back through the CLI.

What must differ, and is checked to differ only so: an imported run has no requests.parquet,
so each request's window starts at the server (its server request span), not at the client;
it is compared with the original analysed the same way (its requests.parquet set aside).
Jaeger keeps whole microseconds, so through its forms every span boundary may move by up to
2 µs (start and duration each truncated), and a component by at most that per boundary in its
window. The imported clock is the epoch (offset 0): the ledger's lookup times are the
original's plus the run's offset.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pytest

from kvscope import analysis
from kvscope.analysis import ledger
from kvscope.cli import main
from kvscope.contract import otlp_json, rundir, semconv
from kvscope.testkit import jaeger_forms

RUN = Path(__file__).parent / "data" / "live-tiny-kvscope"
JAEGER_US_NS = 2_000  # how far Jaeger's microseconds may move one span boundary


def _otlp_json(request: otlp_json.Request, out: Path) -> None:
    out.write_text(otlp_json.dumps(request))


def _collector_lines(request: otlp_json.Request, out: Path) -> None:
    """The Collector's file exporter: one document per line (here one per resource)."""
    lines = []
    for resource_spans in request.resource_spans:
        one = otlp_json.Request()
        one.resource_spans.add().CopyFrom(resource_spans)
        lines.append(otlp_json.dumps(one))
    out.write_text("\n".join(lines) + "\n")


def _jaeger_api_traces(request: otlp_json.Request, out: Path) -> None:
    out.write_text(json.dumps(jaeger_forms.ui_json(request)))


def _jaeger_ui_downloads(request: otlp_json.Request, out: Path) -> None:
    """The UI's download of each trace, one file per trace, in a directory."""
    out.mkdir()
    for n, trace in enumerate(jaeger_forms.ui_json(request)["data"]):
        (out / f"trace-{n}.json").write_text(json.dumps(trace))


def _jaeger_array(request: otlp_json.Request, out: Path) -> None:
    out.write_text(json.dumps(jaeger_forms.ui_json(request)["data"]))


def _jaeger_api_v3(request: otlp_json.Request, out: Path) -> None:
    out.write_text(json.dumps(jaeger_forms.api_v3_json(request)))


FORMS: dict[str, tuple[Callable[[otlp_json.Request, Path], None], int]] = {
    # form -> (writer, how far it may move a span boundary)
    "otlp-json": (_otlp_json, 0),
    "collector-json-lines": (_collector_lines, 0),
    "jaeger-api-traces": (_jaeger_api_traces, JAEGER_US_NS),
    "jaeger-ui-downloads": (_jaeger_ui_downloads, JAEGER_US_NS),
    "jaeger-top-level-array": (_jaeger_array, JAEGER_US_NS),
    "jaeger-api-v3-over-its-model": (_jaeger_api_v3, JAEGER_US_NS),
}


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> dict:
    """The run as analysed (client windows), and as analysed from its spans alone."""
    base = tmp_path_factory.mktemp("original")
    spans_only = base / "spans-only"
    shutil.copytree(RUN, spans_only)
    (spans_only / rundir.TABLES["requests"].file).unlink()
    rundir.append_table(spans_only, "requests", rundir.empty_table("requests"))
    run = analysis.load_run(RUN)
    exported = base / "exported.json"
    assert main(["export", "otlp", str(RUN), "-o", str(exported)]) == 0
    return {"run": run, "attribution": analysis.attribute(run).set_index("request_id"),
            "server_window": analysis.attribute(analysis.load_run(spans_only))
            .set_index("request_id"),
            "ledger": ledger.table(run.spans), "spans": run.spans,
            "exported": otlp_json.loads(exported.read_bytes())}


@pytest.fixture(scope="module", params=list(FORMS))
def imported(request, original, tmp_path_factory) -> dict:
    writer, slack = FORMS[request.param]
    base = tmp_path_factory.mktemp(request.param)
    writer(original["exported"], base / "traces")
    assert main(["import", str(base / "traces"), "--out", str(base / "run")]) == 0
    run = analysis.load_run(base / "run")
    return {"run": run, "attribution": analysis.attribute(run).set_index("request_id"),
            "slack": slack}


def test_phases_and_each_requests_place_in_the_study_survive(original, imported):
    def phases(run):
        return [(p["name"], p["concurrency"]) for p in run.manifest["phases"]]

    assert phases(imported["run"]) == phases(original["run"]) == [
        ("warm", 1), ("cold-c1", 1), ("cold-c3", 3)]
    columns = ["phase", "concurrency", "prompt_index"]
    want = original["attribution"][columns]
    assert imported["attribution"].loc[want.index, columns].equals(want)
    assert set(imported["attribution"]["window"]) == {"server"}


def test_the_chunk_ledger_survives(original, imported):
    got = ledger.table(imported["run"].spans)
    want = original["ledger"]
    assert len(want) == 36 and set(want["tier"]) == {"disk", "none"}
    same = [c for c in want.columns if c != "lookup_ns"]
    assert got[same].reset_index(drop=True).equals(want[same].reset_index(drop=True))
    offset = original["run"].manifest["clock"]["offset_ns"]
    moved = np.abs(got["lookup_ns"].to_numpy() - (want["lookup_ns"].to_numpy() + offset))
    assert moved.max() <= imported["slack"]


def test_attribution_is_the_originals_request_by_request(original, imported):
    want = original["server_window"]
    got = imported["attribution"].loc[want.index]
    ns = [c for c in want.columns if c.endswith("_ns")]
    rest = [c for c in want.columns if c not in ns and c != "diagnostics"]
    assert got[rest].astype(str).equals(want[rest].astype(str))
    allowed = imported["slack"] * _boundaries_in_window(original["spans"], want)
    moved = (got[ns] - want[ns]).abs().to_numpy()
    assert (moved <= allowed[:, None]).all(), pd.DataFrame(moved, want.index, ns).max()


def test_only_the_window_separates_it_from_the_client_view(original, imported):
    """Against `kvscope analyze` of the original (client windows) the window-free columns
    agree; ttft, other and the batch split follow the window."""
    want = original["attribution"]
    got = imported["attribution"].loc[want.index]
    tokens = [c for c in want.columns if c.startswith(("ledger_", "hit_", "missed_"))]
    assert tokens and got[[*tokens, "read_bytes"]].equals(want[[*tokens, "read_bytes"]])
    assert (got["ttft_ns"] < want["ttft_ns"]).all(), "the server sees the request later"


def _boundaries_in_window(spans: pd.DataFrame, rows: pd.DataFrame) -> np.ndarray:
    """Per request, the span starts and ends (any request's) inside its window, plus its two
    edges: the boundaries whose microsecond truncation can move its components."""
    edges = np.sort(np.concatenate([spans["start_ns"], spans["end_ns"]]))
    servers = spans[spans["name"] == semconv.SPAN_SERVER_REQUEST].set_index("request_id")
    start = servers.loc[rows.index, "start_ns"].to_numpy()
    end = start + rows["ttft_ns"].to_numpy()
    return np.searchsorted(edges, end, "right") - np.searchsorted(edges, start, "left") + 2
