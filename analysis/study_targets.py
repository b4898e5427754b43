"""Issue 24's end-to-end targets for a finished study, and why a run missed each one it missed.

The targets put the new parallel path beside the one before it at c = 8 and 16; a ratio alone
does not say what to change, so each miss is explained from the run's own analysis (its
read_path row and the p50s of its TTFT parts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from kvscope.analysis import outputs, readpath
from kvscope.analysis.study_tables import phase_row
from kvscope.contract import rundir
from kvscope.contract.study_roles import CANDIDATE, CLASSIC

# Issue 24's end-to-end targets at c = 8 and 16: read rate while reading, disk busy share of the
# read span, TTFT p50 over (bytes the request waited for / ceiling + its own prefill).
TARGET_READ, TARGET_BUSY, TARGET_TTFT = 0.95, 0.90, 1.2


def ideal_ttft_ratio(run: Path, phase: str, ceiling_bytes_per_s: float) -> float:
    """TTFT p50 over the p50 of each request's floor: the KV bytes of every request whose first
    token came no later than its own (the worker loads a step's requests before its forward),
    read at the ceiling, plus its own prefill (without other requests' prefill in its batch)."""
    requests = rundir.read_table(run, "requests")
    if requests is None:
        return math.nan
    requests = requests[(requests["phase"] == phase) & (requests["status"] == "ok")]
    if requests.empty or not ceiling_bytes_per_s:
        return math.nan
    per_token = rundir.read_manifest(run)["model"]["kv_bytes_per_token"]
    attribution = outputs.load_attribution(run).set_index("request_id")
    own_prefill = (attribution["prefill_ns"] - attribution.get("batch_prefill_ns", 0)) / 1e9
    first = requests["first_token_ns"].to_numpy()
    kv = requests["cached_tokens"].to_numpy() * per_token
    floors = [kv[first <= f].sum() / ceiling_bytes_per_s
              + float(own_prefill.get(rid, 0.0)) for rid, f in
              zip(requests["request_id"].astype(str), first)]
    return float(requests["ttft_s"].median() / pd.Series(floors).median())


def target_rows(runs: dict[str, Path], table: pd.DataFrame) -> pd.DataFrame:
    """Issue 24's targets at c = 8 and 16 for the new path and the one before it, one run."""
    rows = []
    for row in table[table["profile"].isin([CLASSIC, CANDIDATE])].to_dict("records"):
        if row["conc"] not in (8, 16):
            continue
        ttft = ideal_ttft_ratio(runs[row["profile"]], row["phase"], row["ceiling_GBps"] * 1e9)
        rows.append({
            "profile": row["profile"], "phase": row["phase"], "conc": row["conc"],
            "ttft_p50_s": row["ttft_p50_s"],
            "read_vs_ceiling": row["read_vs_ceiling"],
            "read_vs_busy_ceiling": row["read_vs_busy_ceiling"],
            "disk_busy_share": row["disk_busy_share"],
            "ttft_vs_floor": ttft,
            "met": ", ".join(name for name, ok in (
                ("read", row["read_vs_ceiling"] >= TARGET_READ),
                ("busy", row["disk_busy_share"] >= TARGET_BUSY),
                ("ttft", ttft <= TARGET_TTFT)) if ok) or "none"})
    return pd.DataFrame(rows)


def target_reasons(runs: dict[str, Path], targets: pd.DataFrame) -> list[str]:
    """Why each row missed what it missed, from its run's own analysis: a target's ratio alone
    does not say what to change (more readers, earlier reads, or nothing a read path can do)."""
    lines = []
    for row in targets.to_dict("records"):
        run, phase = runs[row["profile"]], row["phase"]
        reads = phase_row(json.loads((run / "summary.json").read_text()), "read_path", phase)
        attribution = outputs.load_attribution(run)
        p50 = attribution[attribution["phase"] == phase].filter(like="_ns").median() / 1e9
        why = []
        if row["read_vs_ceiling"] < TARGET_READ and reads:
            why.append(_read_reason(row["read_vs_ceiling"], row["read_vs_busy_ceiling"], reads))
        if row["disk_busy_share"] < TARGET_BUSY and reads:
            asked = reads["read_span_s"] - reads["idle_unasked_s"]
            why.append(f"busy {row['disk_busy_share']:.0%}: the disk was idle "
                       f"{reads['idle_s']:.2f} s of the {reads['read_span_s']:.2f} s read span, "
                       f"{reads['idle_unasked_s']:.2f} s of it with no request waiting for its "
                       f"reads (busy {reads['busy_s'] / asked:.0%} of the rest), "
                       f"{reads['idle_transfer_s']:.2f} s while the worker copied loaded chunks, "
                       f"{reads['idle_prefill_s']:.2f} s while it prefilled")
        if row["ttft_vs_floor"] > TARGET_TTFT and not p50.empty:
            why.append(
                f"TTFT {row['ttft_vs_floor']:.2f}x the floor ({row['ttft_p50_s']:.2f} s against "
                f"{row['ttft_p50_s'] / row['ttft_vs_floor']:.2f} s); p50s of its parts: storage "
                f"read {p50['storage_read_ns']:.2f} s ({p50['batch_storage_read_ns']:.2f} s of "
                f"it other requests' loads) at {row['read_vs_ceiling']:.2f}x the ceiling, "
                f"transfer {p50['transfer_ns']:.2f} s ({p50['batch_transfer_ns']:.2f} s other "
                f"requests' copies), prefill {p50['prefill_ns']:.2f} s "
                f"({p50['batch_prefill_ns']:.2f} s other requests'), other "
                f"{p50['other_ns']:.2f} s; the floor counts only the reads at the ceiling and "
                "the request's own prefill")
        if why:
            lines.append(f"{row['profile']} c={row['conc']}: " + "; ".join(why))
    return lines


def _read_reason(share: float, busy_share: float, reads: dict) -> str:
    text = f"read {share:.2f}x the ceiling while reading"
    if not math.isnan(busy_share):
        text += (f" ({busy_share:.2f}x the ceiling scaled to what the disk gave with every CPU "
                 "busy)")
    if reads["in_flight_while_busy"] is None:
        return text
    text += (f": {reads['in_flight_while_busy']:.0f} reads in flight, "
             f"{reads['at_device_while_busy']:.0f} of them at the device, each "
             f"{reads['io_p50_ms']:.1f} ms there (p50)")
    if reads["reader_gap_p50_ms"] is not None:
        text += (f", and each of {reads['readers']} readers {reads['reader_gap_p50_ms']:.1f} ms "
                 f"(p50) between its reads ({readpath.GAP_CAUSES})")
    return text
