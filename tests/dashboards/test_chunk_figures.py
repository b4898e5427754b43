"""The chunk ledger's figures on hand-made ledger rows: what each chunk and bin shows."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvscope.contract import chunk_outcomes
from kvscope.contract import rundir
from kvscope.dashboards import chunks


def ledger_rows(run: str, outcomes: list[tuple[str, str]], *, lookup_ns: int = 0,
                chunk_tokens: int = 256, request_id: str = "r0") -> pd.DataFrame:
    """One request's chunks in prompt order, each (tier, reason)."""
    rows = []
    for i, (tier, reason) in enumerate(outcomes):
        rows.append({"request_id": request_id, "vllm_request_id": f"cmpl-{request_id}",
                     "lookup_ns": lookup_ns, "chunk_index": i, "start_token": i * chunk_tokens,
                     "end_token": (i + 1) * chunk_tokens, "tokens": chunk_tokens,
                     "chunk_hash": f"{i:08x}", "tier": tier, "reason": reason,
                     "detail": "capacity 20 GiB" if reason == chunk_outcomes.EVICTED_DISK else "",
                     "fact_ns": -1, "stored_ns": -1,
                     "diverged_at": 300 if reason == chunk_outcomes.DIVERGED else -1})
    frame = pd.DataFrame(rows, columns=rundir.CHUNK_LEDGER.schema.names)
    return frame.assign(run=run)


def test_strip_has_a_segment_per_chunk_over_its_tokens_named_by_what_happened():
    rows = ledger_rows("parallel", [(chunk_outcomes.TIER_VLLM, ""), (chunk_outcomes.TIER_DISK, ""),
                                    (chunk_outcomes.TIER_NONE, chunk_outcomes.DIVERGED),
                                    (chunk_outcomes.TIER_NONE, chunk_outcomes.DIVERGED)])
    fig = chunks.build_chunk_strip(rows.iloc[::-1])  # any row order: the strip is in prompt order
    by_name = {t.name: t for t in fig.data}
    assert list(by_name) == ["hit: vllm", "hit: disk", "miss: diverged"]
    diverged = by_name["miss: diverged"]
    assert list(diverged.base) == [512, 768] and list(diverged.x) == [256, 256]
    assert all("prefix diverged at token 300" in h for h in diverged.hovertext)
    covered = sorted((b, b + x) for t in fig.data for b, x in zip(t.base, t.x))
    assert covered == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert by_name["hit: disk"].marker.color != diverged.marker.color


def test_strip_escapes_trace_strings_and_says_when_there_is_no_ledger():
    rows = ledger_rows("r", [(chunk_outcomes.TIER_NONE, chunk_outcomes.REFUSED)])
    rows["detail"] = "<b>checksum</b>"
    fig = chunks.build_chunk_strip(rows)
    assert "&lt;b&gt;checksum&lt;/b&gt;" in fig.data[0].hovertext[0]
    blank = chunks.build_chunk_strip(rows.iloc[:0])
    assert not blank.data and "no chunk ledger" in blank.layout.annotations[0].text
    with pytest.raises(ValueError, match="tier"):
        chunks.build_chunk_strip(rows.drop(columns="tier"))


def test_reasons_over_time_bin_every_token_once_per_run_panel():
    first = pd.concat([
        ledger_rows("serial", [(chunk_outcomes.TIER_NONE, chunk_outcomes.NEVER_STORED)] * 2, lookup_ns=0,
                    request_id="a"),
        ledger_rows("serial", [(chunk_outcomes.TIER_DISK, ""), (chunk_outcomes.TIER_NONE, chunk_outcomes.EVICTED_DISK)],
                    lookup_ns=10_000_000_000, request_id="b"),
    ])
    second = ledger_rows("parallel", [(chunk_outcomes.TIER_CPU, "")] * 3, lookup_ns=5_000_000_000)
    fig = chunks.build_miss_reasons(pd.concat([first, second]), bins=10)
    per_panel: dict[tuple[str, str], float] = {}
    for trace in fig.data:
        per_panel[(trace.xaxis, trace.name)] = float(np.sum(trace.y))
    assert per_panel == {("x", "hit: disk"): 256, ("x", "miss: evicted_disk"): 256,
                         ("x", "miss: never_stored"): 512, ("x2", "hit: cpu"): 768}
    never = next(t for t in fig.data if t.name == "miss: never_stored")
    evicted = next(t for t in fig.data if t.name == "miss: evicted_disk")
    assert never.x[int(np.argmax(never.y))] < 1.0 < 9.0 < evicted.x[int(np.argmax(evicted.y))]
    legend = [t.name for t in fig.data if t.showlegend]
    assert len(legend) == len(set(legend)), "one legend entry per outcome across panels"
    assert [a.text for a in fig.layout.annotations] == ["serial", "parallel"]


def test_every_tier_and_reason_has_its_own_colour():
    labels = [chunks.outcome(t, "") for t in chunk_outcomes.TIERS]
    labels += [chunks.outcome(chunk_outcomes.TIER_NONE, r) for r in chunk_outcomes.REASONS]
    colours = [chunks.outcome_color(label) for label in labels]
    assert len(set(colours)) == len(colours)
