"""The device ceiling as a run directory keeps it, and how several measurements become one.

`capture.ceiling` measures a disk; the study keeps the best of every run's measurements per disk
(`best_of`) in each run's manifest, and readers print it. The record's fields and the merge
are defined here once, so the study that writes a ceiling and the reader that renders it (a
manifest's `device_ceiling` with or without `samples`) can never disagree on what "the best of
N measurements" and its spread are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

RAW_METHOD = "raw O_DIRECT preadv, page cache dropped"


@dataclass(frozen=True)
class Ceiling:
    """The best measurement (its rate, bytes, unit, depth, method), with every measurement
    taken in `samples` and the spread of the best configuration's repeats ((best - worst) /
    best: how much the machine drifted between them)."""

    bytes_per_s: float
    bytes: int
    seconds: float
    files: int
    unit: int
    depth: int
    method: str = RAW_METHOD
    when: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)
    spread: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _config(sample: dict[str, Any]) -> tuple:
    return sample.get("method"), sample.get("unit"), sample.get("depth")


def best_of(measurements: Iterable[Ceiling | dict[str, Any]]) -> Ceiling | None:
    """One ceiling from many: the fastest sample, every sample kept, the spread of its
    configuration's repeats.

    Accepts Ceilings or their dicts (a manifest's device_ceiling, with or without samples).
    """
    samples: list[dict[str, Any]] = []
    files = 0
    for m in measurements:
        d = m.as_dict() if isinstance(m, Ceiling) else dict(m or {})
        if not d.get("bytes_per_s"):
            continue
        files = max(files, int(d.get("files", 0)))
        samples += d.get("samples") or [{k: d.get(k) for k in
                                         ("method", "when", "unit", "depth", "bytes", "seconds",
                                          "bytes_per_s")}]
    samples = [s for s in samples if s.get("bytes_per_s")]
    if not samples:
        return None
    best = max(samples, key=lambda s: s["bytes_per_s"])
    same = [s["bytes_per_s"] for s in samples if _config(s) == _config(best)]
    worst = min(same)  # the spread is of the winning configuration's repeats: the drift
    return Ceiling(best["bytes_per_s"], int(best.get("bytes") or 0),
                   float(best.get("seconds") or 0.0), files, int(best.get("unit") or 0),
                   int(best.get("depth") or 0), best.get("method") or RAW_METHOD,
                   best.get("when") or "", samples, (best["bytes_per_s"] - worst) / best["bytes_per_s"])
