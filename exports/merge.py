# SPDX-License-Identifier: Apache-2.0
"""All of a run's OTLP JSON span files as one document, the form Jaeger's UI uploads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvscope.contract import rundir


def merged_otlp(run: Path) -> dict[str, Any]:
    """One ExportTraceServiceRequest holding every resourceSpans of RUN/spans/*.json."""
    files = sorted((Path(run) / rundir.SPANS_DIR).glob("*.json"))
    if not files:
        raise ValueError(f"{Path(run) / rundir.SPANS_DIR} has no span files; run with "
                         "tracing on (kvscope run --tracing, the default)")
    resource_spans: list[Any] = []
    for path in files:
        try:
            resource_spans += json.loads(path.read_text()).get("resourceSpans", [])
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{path} is not an OTLP JSON document ({e}); remove or fix it") from e
    return {"resourceSpans": resource_spans}
