"""Acceptance gates: a candidate run against a baseline run, judged by a gate file.

Where `analysis.gate` guards one run against its own past numbers, these gates say whether a
storage path is worth having, the way the seeds judge one: by TTFT and throughput together
("cold-c16 TTFT p50 reduction >= 25 %", "requests/s ratio >= 1.29", "storage_read share <= 0.5").
A gate file is JSON, {"name": ..., "gates": [GATE, ...]}; a GATE has `name`, `phase`, `metric`
and `min` and/or `max`:

- `reduction` (of `component`, default ttft, at `stat`, default p50): 1 - candidate / baseline
- `speedup` (same keys): baseline / candidate
- `throughput_ratio` (of `rate`, one of analysis.throughput.METRICS, default requests_per_s):
  candidate / baseline, with its 95 % bootstrap interval in the detail
- `share` (of `component` in the candidate's TTFT in the phase): sum(component) / sum(ttft)

A gate is judged over repetitions, by the same rule as the study's headline
(analysis.replicates): each pair of runs (the candidate and the baseline of one block of a
study) gives one value, and a gate passes only when the 95 % interval of those values across
pairs clears its bound (lies above `min`, below `max`). An interval that includes the bound is
"level" with it and fails, and one pair alone (spread unknown) is UNKNOWN and does not pass, so
a rerun of the same study passes or fails the same gates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from kvscope.analysis import replicates, throughput
from kvscope.analysis.compare import PARTS, STATS, rows

METRICS = ("reduction", "speedup", "throughput_ratio", "share")
EXAMPLE = Path(__file__).with_name("gates") / "seeds-g3.json"


def read_gates(path: str | Path) -> dict[str, Any]:
    """Load and check a gate file; ValueError names the file, the gate and what to fix."""
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"gate file {path} cannot be read ({e}); see {EXAMPLE} for one") from None
    gates = body.get("gates") if isinstance(body, dict) else None
    if not gates or not isinstance(gates, list):
        raise ValueError(f"gate file {path}: needs a non-empty list under \"gates\" ({EXAMPLE})")
    for i, g in enumerate(gates):
        where = f"gate file {path}, gate {i} ({g.get('name', 'unnamed') if isinstance(g, dict) else g!r})"
        if not isinstance(g, dict) or not g.get("phase") or g.get("metric") not in METRICS:
            raise ValueError(f"{where}: needs a phase and a metric, one of {list(METRICS)}")
        if "min" not in g and "max" not in g:
            raise ValueError(f"{where}: needs a bound, min and/or max")
        if g.get("component", "ttft") not in PARTS or g.get("stat", "p50") not in STATS:
            raise ValueError(f"{where}: component must be one of {list(PARTS)} and stat one of "
                             f"{sorted(STATS)}")
        if g.get("rate", "requests_per_s") not in throughput.METRICS:
            raise ValueError(f"{where}: rate must be one of {list(throughput.METRICS)}")
    return body


def _stat(attribution: pd.DataFrame, phase: str, component: str, stat: str, which: str) -> float:
    picked = rows(attribution, phase)
    if picked.empty:
        raise ValueError(f"no complete requests in phase {phase!r} of the {which} run; pick a "
                         "phase both runs have")
    return float(STATS[stat](picked[f"{component}_ns"].to_numpy("float64")[None, :] / 1e9)[0])


def _value(gate: dict[str, Any], base: dict[str, pd.DataFrame],
           cand: dict[str, pd.DataFrame]) -> tuple[float, str]:
    """The gate's measured value and a sentence of what it came from."""
    phase, metric = gate["phase"], gate["metric"]
    component, stat = gate.get("component", "ttft"), gate.get("stat", "p50")
    if metric in ("reduction", "speedup"):
        b = _stat(base["attribution"], phase, component, stat, "baseline")
        c = _stat(cand["attribution"], phase, component, stat, "candidate")
        value = 1 - c / b if metric == "reduction" else b / c
        return value, f"{component} {stat}: baseline {b:.4f} s, candidate {c:.4f} s"
    if metric == "share":
        picked = rows(cand["attribution"], phase)
        total = float(picked["ttft_ns"].sum())
        if not total:
            raise ValueError(f"no complete requests in phase {phase!r} of the candidate run")
        return float(picked[f"{component}_ns"].sum()) / total, f"{component} over TTFT, candidate"
    rate = gate.get("rate", "requests_per_s")
    table = throughput.ratio(base["requests"], cand["requests"], phase).set_index("metric")
    if rate not in table.index:
        raise ValueError(f"{rate} is zero in phase {phase!r} of the baseline run: no ratio")
    r = table.loc[rate]
    return float(r["ratio"]), (f"{rate}: baseline {r['a']:.3f}, candidate {r['b']:.3f}, "
                               f"95 % CI of the ratio [{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}]")


def check(gates: dict[str, Any],
          pairs: list[tuple[dict[str, pd.DataFrame], dict[str, pd.DataFrame]]]) -> pd.DataFrame:
    """One row per gate: value (over `pairs`: a geometric mean, as the interval), its 95 %
    interval across pairs (`lo`, `hi`, NaN with one), `reps`, bounds, pass / FAIL / UNKNOWN
    and what the first pair's value came from.

    `pairs`: (baseline, candidate) per repetition, each {"attribution": ..., "requests": ...}.

    Raises:
        ValueError: no pair, or a phase a run lacks.
    """
    if not pairs:
        raise ValueError("no pair of runs to judge: give a candidate and a baseline run per "
                         "repetition")
    out = []
    for g in gates["gates"]:
        measured = [_value(g, base, cand) for base, cand in pairs]
        values = [value for value, _ in measured]
        s = (replicates.spread([1 - v for v in values]).complement() if g["metric"] ==
             "reduction" else replicates.spread(values))
        low, high = g.get("min"), g.get("max")
        clears = ((low is None or replicates.standing(s, low) == replicates.ABOVE)
                  and (high is None or replicates.standing(s, high) == replicates.BELOW))
        status = ("UNKNOWN" if replicates.standing(s) == replicates.UNKNOWN
                  else "pass" if clears else "FAIL")
        out.append({"gate": g.get("name") or f"{g['phase']} {g['metric']}", "value": s.center,
                    "lo": s.lo, "hi": s.hi, "reps": s.reps, "min": low, "max": high,
                    "status": status, "detail": measured[0][1]})
    return pd.DataFrame(out, columns=["gate", "value", "lo", "hi", "reps", "min", "max",
                                      "status", "detail"])


def spread_words(r: Any) -> str:
    """A result row's interval across repetitions, or why it has none."""
    if r.reps < 2:
        return ("one repetition: the spread across runs is unknown, so no gate passes; give "
                "the runs of 2 or more repetitions (kvscope demo --repeats 3)")
    return f"95 % interval across {r.reps} repetitions [{r.lo:.4f}, {r.hi:.4f}]"


def bounds(r: Any) -> str:
    """A result row's bounds in words: ">= 0.25", "<= 0.5" or both."""
    return " and ".join(b for b in (f">= {r.min:g}" if pd.notna(r.min) else "",
                                    f"<= {r.max:g}" if pd.notna(r.max) else "") if b)


def failure_message(r: Any) -> str:
    return (f"{r.gate}: {r.value:.4f} is not {bounds(r)} over the whole interval "
            f"({spread_words(r)}; first repetition: {r.detail})")
