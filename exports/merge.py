# SPDX-License-Identifier: Apache-2.0
"""All of a run's OTLP JSON span files as one document, the form Jaeger's UI uploads."""

from __future__ import annotations

from pathlib import Path

from kvscope.contract import otlp_json, rundir


def merged_otlp(run: Path) -> otlp_json.Request:
    """One ExportTraceServiceRequest holding every resourceSpans of RUN/spans/*.json (read and
    written through contract.otlp_json, so a run from an older kvscope comes out spec-exact)."""
    files = sorted((Path(run) / rundir.SPANS_DIR).glob("*.json"))
    if not files:
        raise ValueError(f"{Path(run) / rundir.SPANS_DIR} has no span files; run with "
                         "tracing on (kvscope run --tracing, the default)")
    merged = otlp_json.Request()
    for path in files:
        document = rundir.read_file(path, rundir.SPAN_FILE_MAX_BYTES)
        try:
            merged.MergeFrom(otlp_json.loads(document))
        except otlp_json.OtlpJsonError as e:
            raise ValueError(f"{path} is not an OTLP JSON document ({e}); remove or fix it") \
                from None
    return merged
