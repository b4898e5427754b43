"""Helpers the analysis tests import by name (a fixture cannot feed hypothesis's @given)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from kvscope.analysis.otlp import empty_spans
from kvscope.analysis.run import Run, empty_table


def memory_run(requests: list[dict[str, Any]], spans: list[dict[str, Any]],
               block_io: list[dict[str, Any]] | None = None) -> Run:
    """A Run built in memory: each request needs request_id, arrival_ns, first_token_ns;
    each span request_id, name, start_ns, end_ns (and optionally attributes, and the emitting
    process as service and pid: by default all spans come from one vLLM process, pid 1)."""
    req = pd.DataFrame([{"phase": "cold", "concurrency": 1, "prompt_index": i, "status": "ok",
                         "error": "", **r} for i, r in enumerate(requests)])
    span_frame = empty_spans() if not spans else pd.DataFrame([
        {"trace_id": f"{i:032x}", "span_id": f"{i:016x}", "parent_span_id": "",
         "attributes": {}, "service": "kvscope-vllm", "pid": 1, **s}
        for i, s in enumerate(spans)])
    blocks = empty_table("block_io") if not block_io else pd.DataFrame([
        {"phase": "cold", "device": "vda", "dev": "254:0", "sector": 0, "bytes": 4096, "op": "R",
         "pid": 1, "comm": "t", "error": 0, **b} for b in block_io])
    return Run(Path("memory"), {}, req, span_frame, blocks, empty_table("queue_depth"),
               empty_table("nvme_io"))
