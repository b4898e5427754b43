"""Write imported traces as a run directory, and fetch them from Jaeger's OTLP query API.

The spans keep their OTLP epoch-ns times: the manifest's clock offset is 0, so the run's
"monotonic" clock is the epoch and no probe table joins unless one is supplied with its own
offset. requests.parquet is empty; analysis makes a row per server request span found.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from kvscope.contract import files, host, rundir
from kvscope.capture.trace_import.documents import TraceImportError, read_text
from kvscope.contract import semconv
from kvscope.tracer.fileexport import otlp_json

Request = trace_service_pb2.ExportTraceServiceRequest
PHASE = "imported"


def fetch_v3(url: str, service: str, since_s: float, limit: int) -> list[Request]:
    """Traces of `service` from the last `since_s` seconds from Jaeger's /api/v3/traces."""
    now = datetime.now(timezone.utc)
    query = urllib.parse.urlencode({
        "query.service_name": service,
        "query.start_time_min": _rfc3339(now - timedelta(seconds=since_s)),
        "query.start_time_max": _rfc3339(now), "query.num_traces": limit})
    address = f"{url.rstrip('/')}/api/v3/traces?{query}"
    try:
        with urllib.request.urlopen(address, timeout=60) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as e:
        raise TraceImportError(f"{address}: HTTP {e.code} ({e.reason}); is --url Jaeger's query "
                               "service (port 16686) and --service a service it knows?") from None
    except OSError as e:
        raise TraceImportError(f"{address}: cannot connect ({e}); pass Jaeger's query URL, e.g. "
                               "http://jaeger:16686") from None
    return read_text(text, address)


def _rfc3339(moment: datetime) -> str:
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def write_run(out: Path, messages: list[Request], source: str) -> dict[str, Any]:
    """A run directory at `out` holding `messages`; what it found (for the closing line)."""
    spans = [span for m in messages for rs in m.resource_spans for ss in rs.scope_spans
             for span in ss.spans]
    servers = [s for s in spans if s.name == semconv.SPAN_SERVER_REQUEST]
    if not servers:
        services = sorted({a.value.string_value for m in messages for rs in m.resource_spans
                           for a in rs.resource.attributes if a.key == "service.name"})
        raise TraceImportError(
            f"{source}: {len(spans)} spans but no {semconv.SPAN_SERVER_REQUEST} span (services "
            f"found: {', '.join(services) or 'none'}); import the traces of a vLLM server run "
            "with KVSCOPE_TRACING=1 (service kvscope-vllm)")
    first = min(s.start_time_unix_nano for s in spans)
    last = max(s.end_time_unix_nano for s in spans)
    run = rundir.create(out, _manifest(out, source, first, last))
    for number, message in enumerate(messages):
        files.atomic_write(run / rundir.SPANS_DIR / f"imported-{number:06d}.json",
                           json.dumps(otlp_json(message), separators=(",", ":")))
    rundir.append_table(run, "requests", rundir.empty_table("requests"))
    return {"run": run, "spans": len(spans), "requests": len({s.trace_id for s in servers})}


def _manifest(out: Path, source: str, first_ns: int, last_ns: int) -> dict[str, Any]:
    return {
        "run_id": out.resolve().name,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": ["kvscope", *sys.argv[1:]],
        "model": {}, "backend": {}, "server": {"started_by": "user"},
        "workload": {"imported_from": source, "phases": [PHASE]},
        "machine": {}, "versions": host.versions(),
        "clock": {"offset_ns": 0, "uncertainty_ns": 0,
                  "note": "imported spans keep OTLP epoch ns; no probe table joins"},
        "phases": [{"name": PHASE, "kind": "imported", "concurrency": -1,
                    "started_ns": first_ns, "ended_ns": last_ns}],
    }
