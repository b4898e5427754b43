# SPDX-License-Identifier: Apache-2.0
"""The loaded runs and the frames each view shows, taken from `analysis` and nothing else.

`load_runs` runs once, in the app factory. The selectors below only filter, label and
concatenate what analysis produced (a `run` column, a request `key`): no attribution here.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, cast

import numpy as np
import pandas as pd

from kvscope import analysis
from kvscope.contract import rundir


class DashboardError(ValueError):
    """A run the dashboard cannot show; the message names the run and what to do."""


@dataclass(frozen=True)
class RunData:
    """One run as the dashboard shows it: the analysis Run, its attribution and summary."""

    label: str
    run: analysis.Run
    attribution: pd.DataFrame  # analysis.attribute + run, key, arrival_ns, trace_id
    summary: dict
    chunk_ledger: pd.DataFrame  # contract.rundir.CHUNK_LEDGER rows + run, phase

    @property
    def kv_device(self) -> str:
        """The disk holding the KV path (manifest machine.disk_device), else the busiest one."""
        named = str(self.run.manifest.get("machine", {}).get("disk_device") or "")
        if named:
            return Path(named).name
        reads = self.run.block_io[self.run.block_io["op"] == "R"]
        return "" if reads.empty else str(reads.groupby("device")["bytes"].sum().idxmax())

    # Indexes built on first use, so a click looks its request up instead of scanning tables.
    @functools.cached_property
    def rows_by_key(self) -> dict[str, int]:
        return {k: i for i, k in enumerate(self.attribution["key"])}

    @functools.cached_property
    def requests_by_key(self) -> dict[tuple[str, str], int]:
        req = self.run.requests
        return {(p, r): i for i, (p, r) in enumerate(zip(req["phase"], req["request_id"]))}

    @functools.cached_property
    def spans_by_request(self) -> dict[str, np.ndarray]:
        # pandas-stubs type the keys as Hashable; request ids are strings (contract.spantable)
        return cast(dict[str, np.ndarray],
                    self.run.spans.groupby("request_id", sort=False).indices)

    @functools.cached_property
    def kv_depth(self) -> pd.DataFrame:
        """Whole-device depth of the KV disk, in time order."""
        q = self.run.queue_depth
        return q[(q["device"] == self.kv_device) & (q["hw_queue"] < 0)].sort_values(
            "ts_ns", kind="stable").reset_index(drop=True)

    @functools.cached_property
    def kv_io(self) -> pd.DataFrame:
        """Block I/Os of the KV disk, by start time."""
        io = self.run.block_io
        return io[io["device"] == self.kv_device].sort_values("start_ns", kind="stable")


def request_key(label: str, phase: str, request_id: str) -> str:
    """The value that names one request of one run in dropdowns and click data."""
    return json.dumps([label, phase, request_id])


MAX_KEY_CHARS = 4096  # a key is three short strings; a longer one is not one of ours


class BadKey(ValueError):
    """A value that is not a request key at all (not a JSON list of three strings)."""


def parse_key(key: str) -> tuple[str, str, str]:
    """(label, phase, request_id) of a key made by `request_key`; BadKey for anything else
    (keys arrive in URLs: any text, nested any depth)."""
    if len(key) > MAX_KEY_CHARS:
        raise BadKey(f"a request key is at most {MAX_KEY_CHARS} characters")
    try:
        parts = json.loads(key)
    except (ValueError, RecursionError):
        raise BadKey("a request key is a JSON list of three strings") from None
    if not (isinstance(parts, list) and len(parts) == 3 and all(isinstance(p, str) for p in parts)):
        raise BadKey("a request key is a JSON list of three strings")
    label, phase, request_id = parts
    return label, phase, request_id


def _load_one(path: Path, label: str) -> RunData:
    """The run from its analysis outputs when they are current (`kvscope analyze` wrote them
    from these very inputs), else read and analysed here."""
    from kvscope.analysis import ledger, outputs

    try:
        current = outputs.load_current(path) if path.is_dir() else None
        run = current[0] if current else analysis.load_run(path)
    except (OSError, rundir.RunDirError) as e:
        raise DashboardError(f"cannot read run {path}: {e}") from None
    if run.requests.empty:
        why = "; ".join(run.problems) or "requests.parquet has no rows"
        raise DashboardError(f"run {path} has no requests to show ({why}); "
                             "pass a directory written by `kvscope run`")
    if current:
        attribution, summary = current[1], current[2]
        chunks = outputs.load_chunk_ledger(path)
        if chunks is None:  # missing or damaged: made again, as the other outputs are
            chunks = ledger.of_run(run)
    else:
        attribution = analysis.attribute(run)
        summary = analysis.summarize(run, attribution)
        chunks = ledger.of_run(run)
    extra = run.requests[["request_id", "phase", "arrival_ns", "trace_id"]]
    attribution = attribution.merge(extra, on=["request_id", "phase"], how="left")
    keys = [request_key(label, p, r) for p, r in zip(attribution["phase"], attribution["request_id"])]
    phase_of = run.requests[["request_id", "phase"]].drop_duplicates("request_id")
    chunks = chunks.merge(phase_of, on="request_id", how="left").assign(run=label)
    attribution = attribution.assign(run=label, key=keys)
    return RunData(label, run, attribution, summary, chunks)


def load_runs(paths: Iterable[str | Path]) -> dict[str, RunData]:
    """Load and analyse each run once; labels are run ids, made unique by a #n suffix."""
    runs: dict[str, RunData] = {}
    for path in map(Path, paths):
        base = path.resolve().name
        label = base if base not in runs else f"{base} #{len(runs) + 1}"
        runs[label] = _load_one(path, label)
    if not runs:
        raise DashboardError("no runs given; pass one or more run directories")
    return runs


def _pick(runs: dict[str, RunData], labels: list[str] | None) -> list[RunData]:
    return [runs[label] for label in (labels or []) if label in runs]


COLD = "cold*"  # the phase choice meaning every cold phase (the study's question)
ALL = "all"  # the phase choice meaning every phase (as None does)


def in_phase(phases: pd.Series, phase: str | None) -> pd.Series:
    """Which rows the phase choice keeps: one phase, every cold phase (COLD), or all."""
    if not phase or phase == ALL:
        return pd.Series(True, index=phases.index)
    if phase == COLD:
        return phases.astype(str).str.startswith("cold")
    return phases == phase


def default_phase(runs: dict[str, RunData]) -> str:
    """The view the app opens on: the cold phases when any run has one, else every phase."""
    return COLD if any(p.startswith("cold") for p in phases(runs)) else ALL


def _rows_of(runs: dict[str, RunData], labels: list[str] | None, phase: str | None,
             table: str) -> pd.DataFrame:
    """One per-run table (`attribution`, `chunk_ledger`) of the selected runs, concatenated and
    kept to the phase choice; empty, with its columns, when no run is selected."""
    frames = [getattr(rd, table) for rd in _pick(runs, labels)]
    if not frames:
        return getattr(next(iter(runs.values())), table).iloc[0:0]
    frame = pd.concat(frames, ignore_index=True)
    return frame[in_phase(frame["phase"], phase)]


def attribution_of(runs: dict[str, RunData], labels: list[str] | None,
                   phase: str | None = None) -> pd.DataFrame:
    """The selected runs' per-request attribution, optionally one phase (or COLD) only."""
    frame = _rows_of(runs, labels, phase, "attribution")
    return frame[frame["ttft_ns"].notna()]  # failed requests: counted in findings_of


def _summary_rows(runs: dict[str, RunData], labels: list[str] | None, phase: str | None,
                  key: str) -> list[tuple[RunData, dict]]:
    """(run, row) for the rows of each selected run's summary[key] in the phase choice."""
    return [(rd, row) for rd in _pick(runs, labels) for row in rd.summary.get(key, [])
            if in_phase(pd.Series([row["phase"]]), phase).iloc[0]]


def percentiles_of(runs: dict[str, RunData], labels: list[str] | None,
                   phase: str | None = None) -> pd.DataFrame:
    """summarize()'s per-(phase, concurrency) percentiles, long form, one series per group."""
    rows = []
    for rd, group in _summary_rows(runs, labels, phase, "groups"):
        series = f"{rd.label} · {group['phase']} c={group['concurrency']}"
        for component, stats in group["percentiles_ns"].items():
            rows += [{"run": rd.label, "series": series, "phase": group["phase"],
                      "concurrency": group["concurrency"], "component": component,
                      "percentile": name, "value_ns": value}
                     for name, value in stats.items() if name != "mean"]
    return pd.DataFrame(rows, columns=["run", "series", "phase", "concurrency", "component",
                                       "percentile", "value_ns"])


def throughput_of(runs: dict[str, RunData], labels: list[str] | None,
                  phase: str | None = None) -> pd.DataFrame:
    """summarize()'s throughput per (phase, concurrency), long form: run, level, metric, value."""
    rows = []
    for rd, r in _summary_rows(runs, labels, phase, "throughput"):
        rows += [{"run": rd.label, "phase": r["phase"], "concurrency": r["concurrency"],
                  "level": f"{r['phase']} c={r['concurrency']}", "metric": name,
                  "value": r.get(key)}
                 for key, name in THROUGHPUT_METRICS.items() if r.get(key) is not None]
    return pd.DataFrame(rows, columns=["run", "phase", "concurrency", "level", "metric", "value"])


THROUGHPUT_METRICS = {"requests_per_s": "requests/s",
                      "storage_tokens_per_s": "prompt tokens/s from storage",
                      "output_tokens_per_s": "output tokens/s"}


def phases(runs: dict[str, RunData]) -> list[str]:
    return list(dict.fromkeys(p for rd in runs.values() for p in rd.attribution["phase"]))


MAX_OPTIONS = 200  # the dropdown lists this many; typing searches every request


def request_options(runs: dict[str, RunData], labels: list[str] | None, phase: str | None,
                    search: str | None = None, keep: str | None = None) -> list[dict[str, str]]:
    """Dropdown options, slowest first: the first MAX_OPTIONS matching `search`, plus `keep`."""
    frame = attribution_of(runs, labels, phase).sort_values("ttft_ns", ascending=False)
    if search:
        frame = frame[frame["request_id"].str.contains(search, case=False, regex=False)]
    frame = pd.concat([frame.head(MAX_OPTIONS), frame[frame["key"] == keep]]).drop_duplicates("key")
    return [{"label": f"{run} · {p} · {rid} · {ttft / 1e6:.1f} ms", "value": key}
            for run, p, rid, ttft, key in zip(frame["run"], frame["phase"], frame["request_id"],
                                                frame["ttft_ns"], frame["key"])]


def findings_of(runs: dict[str, RunData], labels: list[str] | None) -> pd.DataFrame:
    """Analysis findings (they include the run's data problems), plus failed requests not plotted."""
    rows = []
    for rd in _pick(runs, labels):
        failed = rd.summary.get("requests", {}).get("failed", 0)
        if failed:
            rows.append({"run": rd.label, "severity": "data", "finding": "failed-requests",
                         "message": f"{failed} failed requests have no TTFT and are not plotted"})
        for f in rd.summary.get("findings", []):
            rows.append({"run": rd.label, "severity": f.get("severity", ""),
                         "finding": f.get("id", ""), "message": f.get("message", "")})
    return pd.DataFrame(rows, columns=["run", "severity", "finding", "message"])


def device_of(runs: dict[str, RunData], labels: list[str] | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Whole-device depth and completed reads of each selected run's KV disk."""
    depth, reads = [], []
    for rd in _pick(runs, labels):
        q, io = rd.run.queue_depth, rd.run.block_io
        depth.append(q[(q["device"] == rd.kv_device) & (q["hw_queue"] < 0)].assign(run=rd.label))
        reads.append(io[(io["device"] == rd.kv_device) & (io["op"] == "R")].assign(run=rd.label))
    empty = pd.DataFrame(columns=["run", "ts_ns", "inflight", "start_ns", "complete_ns", "bytes"])
    return (pd.concat(depth, ignore_index=True) if depth else empty,
            pd.concat(reads, ignore_index=True) if reads else empty)


def nvme_of(runs: dict[str, RunData], labels: list[str] | None) -> pd.DataFrame | None:
    """NVMe commands of the selected runs, or None when none of them recorded any."""
    frames = [rd.run.nvme_io.assign(run=rd.label) for rd in _pick(runs, labels)
              if not rd.run.nvme_io.empty]
    return pd.concat(frames, ignore_index=True) if frames else None


def chunk_ledger_of(runs: dict[str, RunData], labels: list[str] | None,
                    phase: str | None = None) -> pd.DataFrame:
    """The selected runs' chunk ledger rows (with `run`), optionally one phase (or COLD)."""
    return _rows_of(runs, labels, phase, "chunk_ledger")


def chunk_tally_of(runs: dict[str, RunData], labels: list[str] | None,
                   phase: str | None = None) -> pd.DataFrame:
    """Per run of the selection: tokens per tier that served them and per miss reason, with the
    share (of all looked-up tokens for a tier, of the missed ones for a reason) and the TTFT
    cost, by analysis' ledger tally of the phase's rows."""
    from kvscope.analysis import ledger
    from kvscope.contract.chunk_outcomes import TIER_NONE
    from kvscope.dashboards.chunks import outcome

    rows = []
    for rd in _pick(runs, labels):
        chunks = rd.chunk_ledger[in_phase(rd.chunk_ledger["phase"], phase)]
        rate = (rd.summary.get("chunk_ledger") or {}).get("prefill_ns_per_token")
        tally = ledger.tally(chunks, rate)
        if tally is None:
            continue
        rows += [{"run": rd.label, "outcome": outcome(tier, ""), "chunks": t["chunks"],
                  "tokens": t["tokens"], "share": t["hit_rate"], "ttft_cost_s": None,
                  "detail": ""}
                 for tier, t in tally["tiers"].items() if t["tokens"]]
        rows += [{"run": rd.label, "outcome": outcome(TIER_NONE, m["reason"]),
                  "chunks": m["chunks"],
                  "tokens": m["tokens"], "share": m["share_of_missed"],
                  "ttft_cost_s": m["ttft_cost_s"], "detail": next(iter(m["details"]), "")}
                 for m in tally["misses"]]
    return pd.DataFrame(rows, columns=["run", "outcome", "chunks", "tokens", "share",
                                       "ttft_cost_s", "detail"])


def chunks_of(runs: dict[str, RunData], key: str) -> pd.DataFrame:
    """The chunk ledger rows of the request named by `key`, in prompt order."""
    label, _, request_id = parse_key(key)
    rows = runs[label].chunk_ledger
    return rows[rows["request_id"] == request_id].sort_values("chunk_index", kind="stable")


@dataclass(frozen=True)
class RequestView:
    """What the waterfall of one request shows, on the run's monotonic clock."""

    label: str
    row: dict  # the request's attribution row
    spans: pd.DataFrame
    io: pd.DataFrame  # block I/Os on the KV disk that overlap the request
    depth: pd.DataFrame  # whole-device in-flight depth of the KV disk
    arrival_ns: int
    first_token_ns: int
    trace_id: str
    notes: list[str]  # what analysis noted about this request's spans


def request_of(runs: dict[str, RunData], key: str) -> RequestView:
    """The spans, overlapping block I/Os and device depth of the request named by `key`."""
    label, phase, request_id = parse_key(key)
    rd = runs[label]
    row = rd.attribution.iloc[rd.rows_by_key[key]].to_dict()
    request = rd.run.requests.iloc[rd.requests_by_key[(phase, request_id)]]
    spans = rd.run.spans.iloc[rd.spans_by_request.get(request_id, np.array([], dtype=int))]
    if request["trace_id"]:
        spans = spans[spans["trace_id"] == request["trace_id"]]
    arrival, first = int(request["arrival_ns"]), int(request["first_token_ns"])
    end = max(first, int(request["arrival_ns"]), int(spans["end_ns"].max()) if len(spans) else 0)
    io = rd.kv_io
    io = io.iloc[:np.searchsorted(io["start_ns"].to_numpy(), end, "left")]
    io = io[io["complete_ns"] > arrival]
    depth = rd.kv_depth
    notes = list(rd.run.request_notes.get(request_id, []))
    return RequestView(label, row, spans, io, depth, arrival, first, str(request["trace_id"]), notes)
