"""The manifest a run directory starts with, made one way by every producer.

`kvscope run`, `record`, `probe` and `import` each start a run; their manifests differ in what
they know (a model, a workload, a server), never in how the common keys are made: the run id is
the directory's own name, `created_at` is UTC to the second, `versions` are the installed
packages (contract.host), `clock` is the run's offset (contract.clock).
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timezone
from typing import Any

from kvscope.contract import host
from kvscope.contract.clock import ClockOffset


def new(out: str | os.PathLike[str], *, machine: dict[str, Any], clock: ClockOffset,
        model: dict[str, Any] | None = None, backend: dict[str, Any] | None = None,
        workload: dict[str, Any] | None = None, command: list[str] | None = None,
        clock_note: str = "", phases: list[dict[str, Any]] | None = None,
        **sections: Any) -> dict[str, Any]:
    """A manifest with every key contract.rundir requires, for a run at `out`; `command`
    defaults to this kvscope command line, `sections` are the producer's own (server, ...)."""
    clock_block: dict[str, Any] = {"offset_ns": clock.offset_ns,
                                   "uncertainty_ns": clock.uncertainty_ns}
    if clock_note:
        clock_block["note"] = clock_note
    return {
        "run_id": os.path.basename(os.path.abspath(out)),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": list(command) if command is not None else ["kvscope", *sys.argv[1:]],
        "model": model or {}, "backend": backend or {}, "workload": workload or {},
        **sections,
        "machine": machine, "versions": host.versions(),
        "clock": clock_block,
        "phases": phases or [],
    }
