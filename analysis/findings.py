"""Findings: short sentences that say why TTFT went where it went (summary["findings"])."""

from __future__ import annotations

from typing import Any

import pandas as pd

from kvscope.analysis import ledger
from kvscope.analysis.run import Run

Finding = dict[str, str]
SHARE_NOTABLE = 0.30  # a component above this share of TTFT gets a finding
SATURATED_DEPTH = 4.0  # mean in-flight requests that count as a deep queue
SHALLOW_DEPTH = 2.0
CEILING_SATURATED = 0.8  # reads at this share of the measured device ceiling saturate it


def find(run: Run, attribution: pd.DataFrame, summary: dict[str, Any]) -> list[Finding]:
    """Every finding for the run, most severe first."""
    found: list[Finding] = []
    for rule in (_input_problems, _partial_rows, _unmatched_spans, _cache_misses, _vllm_queue,
                 _batch_wait, _storage_bound, _read_path, _disk_backend, _miss_reason):
        found += rule(run, attribution, summary)
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(found, key=lambda f: order[f["severity"]])


def _miss_reason(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    """One miss reason holds most of the tokens the KV cache did not serve."""
    message = ledger.finding(summary.get("chunk_ledger"))
    return [_finding("miss-reason", "info", message)] if message else []


def _finding(id_: str, severity: str, message: str) -> Finding:
    return {"id": id_, "severity": severity, "message": message}


def _input_problems(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    return [_finding("input", "warning", p) for p in run.problems]


def _partial_rows(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    partial = attribution["partial"].astype(bool)
    if len(attribution) == 0:
        return [_finding("no-requests", "error", "the run has no requests to attribute")]
    if not partial.any():
        return []
    reasons = attribution.loc[partial, "diagnostics"].str.split("; ").explode()
    top = reasons.str.replace(r"[\d.]+", "N", regex=True).value_counts().head(3)
    listed = "; ".join(f"{count} x {reason}" for reason, count in top.items())
    return [_finding("partial", "warning", f"{int(partial.sum())} of {len(attribution)} requests "
                     f"have partial attributions, left out of the percentiles: {listed}")]


def _unmatched_spans(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    unknown = ~run.spans["request_id"].isin(run.requests["request_id"].astype(str))
    if not unknown.any():
        return []
    ids = run.spans.loc[unknown, "request_id"].unique()
    return [_finding("unmatched-spans", "warning", f"{int(unknown.sum())} spans name "
                     f"{len(ids)} request ids that requests.parquet lacks (e.g. {ids[0]!r}); "
                     "they are not attributed")]


def _complete(attribution: pd.DataFrame) -> pd.DataFrame:
    return attribution[~attribution["partial"].astype(bool)]


def _cache_misses(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    """Requests that read nothing from storage although their prompt was seen before."""
    rows = _complete(attribution).merge(run.requests[["request_id", "cached_tokens"]],
                                        on="request_id")
    out = []
    for phase, group in rows.groupby("phase", sort=False):
        missed = (group["read_bytes"] == 0) & (group["cached_tokens"] <= 0)
        if missed.any() and phase != "warm":
            out.append(_finding("cache-miss", "warning", f"{int(missed.sum())} of {len(group)} "
                                f"{phase} requests read no KV from storage and reported no "
                                "cached tokens: cache misses, their prompts were recomputed"))
    return out


def _vllm_queue(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    return [_finding("vllm-queue", "info", f"{g['phase']} (conc {g['concurrency']}): "
                     f"{g['share_of_ttft']['queueing']:.0%} of TTFT is waiting in vLLM's queue "
                     "(arrival to first scheduled); more concurrency than the server admits")
            for g in summary["groups"] if (g["share_of_ttft"]["queueing"] or 0) > SHARE_NOTABLE]


def _batch_wait(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    """Groups whose TTFT is mostly waiting on the same worker's other requests (one step)."""
    out = []
    for g in summary["groups"]:
        share = g["share_of_ttft"]
        waited = {c: share[f"batch_{c}"] or 0 for c in ("storage_read", "transfer", "prefill")}
        total = sum(waited.values())
        if total <= SHARE_NOTABLE:
            continue
        own_read = (share["storage_read"] or 0) - waited["storage_read"]
        out.append(_finding("batch-wait", "warning", f"{g['phase']} (conc {g['concurrency']}): "
                            f"{total:.0%} of TTFT is waiting while the same vLLM worker reads "
                            f"({waited['storage_read']:.0%}), copies ({waited['transfer']:.0%}) "
                            f"and prefills ({waited['prefill']:.0%}) other requests "
                            f"(its own reads: {own_read:.0%}): head-of-line blocking in the "
                            "step, whose KV load serves the batch's requests before one forward, "
                            "so each waits for the whole batch's load; loading the batch faster "
                            "(or each request's KV as soon as it is read) is the fix"))
    return out


def ceiling_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """The device ceiling a run is judged against: its study's (one per device, the best of
    every run's measurements) when it belongs to one, else the run's own."""
    return ((manifest.get("study") or {}).get("device_ceiling")
            or manifest.get("device_ceiling") or {})


def ceiling_words(rate: float, ceiling: dict[str, Any]) -> tuple[float, str]:
    """(share of the ceiling, capped at 1, and how to say it): a rate above the ceiling means
    the ceiling was under-measured, and the words say by how much, never "> 100 %"."""
    best = ceiling["bytes_per_s"]
    n = len(ceiling.get("samples") or [1])
    if rate > best:
        return 1.0, (f"reads ran at {rate / 1e9:.2f} GB/s, faster than the {best / 1e9:.2f} GB/s "
                     f"device ceiling (best of {n} measurements): the ceiling was under-measured "
                     f"by at least {rate / best - 1:.0%}")
    return rate / best, (f"reads ran at {rate / 1e9:.2f} GB/s, {rate / best:.0%} of the "
                         f"{best / 1e9:.2f} GB/s device ceiling (best of {n} measurements)")


def phase_reads(summary: dict, phase: str) -> dict[str, Any] | None:
    """The phase's read rate while a read was in flight (`busy_bytes_per_s`) and the disk's busy
    share of its read span (`busy_share`, None without a span), from the read path's own block
    reads (its reader threads', analysis.readpath) where the phase has them, else from every
    block read of the phase. Another process's few reads seconds away stretch the phase's span,
    not the read path's: 13 of them at c=16 once made a disk busy 86 % of its read span read as
    38 %. The study's tables and these findings both say this one."""
    own = next((r for r in summary.get("read_path", []) if r["phase"] == phase), None)
    if own and own.get("busy_bytes_per_s") and own.get("read_span_s"):
        return {"busy_bytes_per_s": own["busy_bytes_per_s"],
                "busy_share": own["busy_s"] / own["read_span_s"]}
    every = next((r for r in summary["read_bandwidth"]
                  if r["phase"] == phase and r["busy_bytes_per_s"]), None)
    if every is None:
        return None
    return {"busy_bytes_per_s": every["busy_bytes_per_s"],
            "busy_share": every["busy_s"] / every["wall_s"] if every["wall_s"] else None}


def _phase_depth(summary: dict, phase: str) -> float | None:
    """Mean requests in flight during the phase on its busiest device."""
    means = [d["mean"] for d in summary.get("queue_depth_by_phase", []) if d["phase"] == phase]
    return max(means, default=None)


def _storage_bound(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    """Storage-dominated groups: at the device ceiling, the ceiling under-measured, or
    software-bound with a shallow queue; every number is the phase's own."""
    ceiling = ceiling_of(run.manifest)
    out = []
    for g in summary["groups"]:
        share = g["share_of_ttft"]["storage_read"] or 0
        if share <= SHARE_NOTABLE:
            continue
        rows = _complete(attribution)
        rows = rows[(rows["phase"] == g["phase"]) & (rows["concurrency"] == g["concurrency"])]
        read = float(rows["storage_read_ns"].sum()) or 1.0
        device = float(rows[["storage_device_queue_ns", "storage_device_service_ns"]].sum().sum())
        depth = _phase_depth(summary, g["phase"])
        reads = phase_reads(summary, g["phase"])
        where = f"{g['phase']} (conc {g['concurrency']}): storage read is {share:.0%} of TTFT"
        of_ceiling = None
        if reads is not None and reads["busy_share"] is not None:
            where += f"; the disk was busy {reads['busy_share']:.0%} of the phase's read span"
        if reads is not None and ceiling.get("bytes_per_s"):
            of_ceiling, words = ceiling_words(reads["busy_bytes_per_s"], ceiling)
            where += f"; {words}"
            if reads["busy_bytes_per_s"] > ceiling["bytes_per_s"]:
                out.append(_finding("ceiling-under-measured", "warning", f"{where}; measure the "
                                    "ceiling again (deeper queue, larger reads) before judging "
                                    "the read path against it"))
                continue
        in_flight = f"{depth:.1f} requests in flight on average in the phase" if depth is not None else ""
        saturated = (of_ceiling >= CEILING_SATURATED if of_ceiling is not None else
                     depth is not None and depth >= SATURATED_DEPTH and device / read > 0.5)
        if saturated:
            out.append(_finding("device-saturated", "warning", f"{where}; {device / read:.0%} of "
                                f"the requests' read time is in the device{', ' if in_flight else ''}"
                                f"{in_flight}: the device is at its ceiling, a faster one "
                                "(or more of them) is the fix"))
        elif depth is not None and depth < SHALLOW_DEPTH:
            out.append(_finding("software-bound", "warning", f"{where}; only {device / read:.0%} "
                                f"of the requests' read time is in the device and {in_flight}: "
                                "reads are software-bound with a shallow queue; read more chunks "
                                "in parallel"))
        else:
            out.append(_finding("storage-bound", "info", f"{where}; {device / read:.0%} of the "
                                f"requests' read time in the device{', ' if in_flight else ''}"
                                f"{in_flight}"))
    return out


def _read_path(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    """Where each cold phase's read bandwidth went (analysis.readpath), when reads matter."""
    from kvscope.analysis import readpath

    notable = {g["phase"] for g in summary["groups"]
               if (g["share_of_ttft"]["storage_read"] or 0) > SHARE_NOTABLE}
    return [_finding("read-path", "info", f"{r['phase']}: {readpath.words(r)}")
            for r in summary.get("read_path", []) if r["phase"] in notable]


def _disk_backend(run: Run, attribution: pd.DataFrame, summary: dict) -> list[Finding]:
    """Chunk files the kvscope backend refused, and reads ahead no load claimed, per phase
    (manifest.disk_backend.by_phase: cumulative counters at each phase's end; runs made before
    the backend wrote its own section had them in manifest.tracer.disk_backend_by_phase)."""
    found: list[Finding] = []
    before: dict[str, Any] = {}
    by_phase = (run.manifest.get("disk_backend", {}).get("by_phase")
                or run.manifest.get("tracer", {}).get("disk_backend_by_phase", {}))
    for phase, now in by_phase.items():
        def grew(name: str) -> int:
            return int(now.get(name, 0)) - int(before.get(name, 0))

        refused = grew("corrupt_chunks")
        if refused > 0:
            was = before.get("corrupt_by_reason", {})
            reasons = ", ".join(f"{count - was.get(reason, 0)} {reason}"
                                for reason, count in now.get("corrupt_by_reason", {}).items()
                                if count > was.get(reason, 0))
            found.append(_finding(
                "refused-chunks", "warning",
                f"{phase}: the kvscope disk backend refused {refused} chunk files ({reasons}); "
                "their tokens were recomputed, never served. Check the disk and the server log "
                "(the files are kept as *.corrupt next to the chunks)"))
        unclaimed = grew("prefetch_unclaimed")
        if unclaimed > 0:
            found.append(_finding(
                "unclaimed-read-ahead", "info",
                f"{phase}: {unclaimed} chunks read ahead at lookup (of {grew('prefetch_reads')} "
                "started) were released without a load claiming them: device time spent for "
                "nothing (requests aborted or never scheduled, or kvscope.prefetch_timeout_s "
                "shorter than their wait)"))
        before = now
    return found
