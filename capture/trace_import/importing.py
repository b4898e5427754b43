"""Write imported traces as a run directory, and fetch them from Jaeger's OTLP query API.

The spans keep their OTLP epoch-ns times: the manifest's clock offset is 0, so the run's
"monotonic" clock is the epoch and no probe table joins unless one is supplied with its own
offset. requests.parquet is empty; analysis makes a row per server request span found. The
phases are the study's when the traces hold kvscope's client spans (`kvscope run` with OTLP on
sends them too): one per `kvscope.phase`, over its client spans, at its `kvscope.concurrency`;
otherwise one phase, `imported`, over every span.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from kvscope.capture.record import bounded_http
from kvscope.capture.trace_import.documents import (MAX_DOCUMENT_BYTES, TraceImportError,
                                                     backend_error, read_text, text_of)
from kvscope.contract import files, manifest, otlp_json, rundir, semconv
from kvscope.contract.clock import ClockOffset

PHASE = "imported"
UNKNOWN_CONCURRENCY = -1
FETCH_TIMEOUT_S = 60.0  # the whole answer of --url
ERROR_BODY_MAX_BYTES = 64 << 10  # of an error answer, shown cut to a line


def fetch_v3(url: str, service: str, since_s: float, limit: int) -> list[otlp_json.Request]:
    """Traces of `service` from the last `since_s` seconds from Jaeger's /api/v3/traces."""
    now = datetime.now(timezone.utc)
    query = urllib.parse.urlencode({
        "query.service_name": service,
        "query.start_time_min": _rfc3339(now - timedelta(seconds=since_s)),
        "query.start_time_max": _rfc3339(now), "query.num_traces": limit})
    address = f"{url.rstrip('/')}/api/v3/traces?{query}"
    try:
        body = bounded_http.get(address, MAX_DOCUMENT_BYTES, FETCH_TIMEOUT_S)
    except bounded_http.AnswerRefused as e:
        raise TraceImportError(f"{e}; ask for less: a shorter --since or a smaller "
                               "--limit") from None
    except urllib.error.HTTPError as e:
        raise TraceImportError(f"{address}: HTTP {e.code} ({e.reason}): {_error_body(e)}; "
                               "is --url Jaeger's query service (port 16686), --service a "
                               "service it knows and --since long enough?") from None
    except (OSError, http.client.HTTPException, ValueError) as e:  # ValueError: no URL
        raise TraceImportError(f"{address}: cannot connect ({e}); pass Jaeger's query URL, "
                               "e.g. http://jaeger:16686") from None
    return read_text(text_of(body, address), address)


def _error_body(error: urllib.error.HTTPError) -> str:
    """What the backend said, from its JSON error answer or its text (its first
    ERROR_BODY_MAX_BYTES: an error answer may be endless too)."""
    try:
        text = error.read(ERROR_BODY_MAX_BYTES).decode(errors="replace").strip()
    except (OSError, http.client.HTTPException):
        return "no complete answer body"
    try:
        return backend_error(json.loads(text))
    except (ValueError, RecursionError):
        return otlp_json.short(text, 200) if text else "no answer body"


def _rfc3339(moment: datetime) -> str:
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Imported:
    """What `write_run` made, for the closing line."""

    run: Path
    spans: int
    requests: int
    phases: list[str]
    backwards: int  # spans that ended before they started: left out


def write_run(out: Path, messages: list[otlp_json.Request], source: str) -> Imported:
    """A run directory at `out` holding `messages` (less any span that ends before it starts,
    which no analysis could place)."""
    backwards = sum(_drop_backwards(message) for message in messages)
    spans = [span for message in messages for span in otlp_json.spans(message)]
    servers = [s for s in spans if s.name == semconv.SPAN_SERVER_REQUEST]
    if not servers:
        services = sorted({a.value.string_value for m in messages for rs in m.resource_spans
                           for a in rs.resource.attributes if a.key == semconv.SERVICE_NAME})
        raise TraceImportError(
            f"{source}: {len(spans)} spans but no {semconv.SPAN_SERVER_REQUEST} span (services "
            f"found: {', '.join(services) or 'none'}); import the traces of a vLLM server run "
            "with KVSCOPE_TRACING=1 (service kvscope-vllm)")
    phases = _phases(spans)
    run = rundir.create(out, manifest.new(
        out, machine={}, clock=ClockOffset(0, 0), server={"started_by": "user"},
        clock_note="imported spans keep OTLP epoch ns; no probe table joins",
        workload={"imported_from": source, "phases": [p["name"] for p in phases]},
        phases=phases))
    for number, message in enumerate(messages):
        files.atomic_write(run / rundir.SPANS_DIR / f"imported-{number:06d}.json",
                           otlp_json.dumps(message))
    rundir.append_table(run, "requests", rundir.empty_table("requests"))
    return Imported(run, len(spans), len({s.trace_id for s in servers}),
                    [p["name"] for p in phases], backwards)


def _drop_backwards(message: otlp_json.Request) -> int:
    dropped = 0
    for resource_spans in message.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            kept = [s for s in scope_spans.spans if s.end_time_unix_nano >= s.start_time_unix_nano]
            if len(kept) < len(scope_spans.spans):
                dropped += len(scope_spans.spans) - len(kept)
                del scope_spans.spans[:]
                scope_spans.spans.extend(kept)
    return dropped


def _phases(spans: list[Any]) -> list[dict[str, Any]]:
    """The manifest's phases: those of kvscope's client spans, or one over everything."""
    by_phase: dict[str, list[Any]] = {}
    for span in spans:
        if span.name == semconv.SPAN_CLIENT_REQUEST:
            attributes = otlp_json.attributes(span.attributes)
            if isinstance(attributes.get(semconv.PHASE), str):
                by_phase.setdefault(attributes[semconv.PHASE], []).append((span, attributes))
    if not by_phase:
        return [_phase(PHASE, spans, UNKNOWN_CONCURRENCY)]
    out = []
    for name, members in by_phase.items():
        levels = {a.get(semconv.CONCURRENCY) for _, a in members}
        level = levels.pop() if len(levels) == 1 else None
        out.append(_phase(name, [s for s, _ in members],
                          level if isinstance(level, int) else UNKNOWN_CONCURRENCY))
    return sorted(out, key=lambda p: p["started_ns"])


def _phase(name: str, spans: list[Any], concurrency: int) -> dict[str, Any]:
    return {"name": name, "kind": "imported", "concurrency": concurrency,
            "started_ns": min(s.start_time_unix_nano for s in spans),
            "ended_ns": max(s.end_time_unix_nano for s in spans)}
