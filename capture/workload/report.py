"""The short table `kvscope run` prints: per phase, TTFT percentiles and bytes read."""

from __future__ import annotations

from pathlib import Path

from kvscope.contract import rundir


def phase_table(run: Path) -> str:
    manifest = rundir.read_manifest(run)
    requests = rundir.read_table(run, "requests")
    lines = [f"{'phase':<10}{'conc':>5}{'ok':>5}{'err':>5}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'cached tok':>12}{'disk read':>12}"]
    for phase in manifest["phases"]:
        rows = requests[requests["phase"] == phase["name"]] if requests is not None else None
        ok = rows[rows["status"] == "ok"] if rows is not None else rows
        p50 = ok["ttft_s"].quantile(0.5) if ok is not None and len(ok) else float("nan")
        p99 = ok["ttft_s"].quantile(0.99) if ok is not None and len(ok) else float("nan")
        cached = int(ok["cached_tokens"].clip(lower=0).sum()) if ok is not None else 0
        lines.append(
            f"{phase['name']:<10}{phase['concurrency']:>5}{phase['num_requests'] - phase['num_errors']:>5}"
            f"{phase['num_errors']:>5}{p50:>9.3f}s{p99:>9.3f}s{cached:>12}"
            f"{phase['disk_read_bytes'] / 2**20:>9.0f}MiB"
        )
    return "\n".join(lines)


def first_failure(run: Path) -> str:
    """The first failed request as 'id: error', or '' when every request succeeded."""
    requests = rundir.read_table(run, "requests")
    if requests is None:
        return ""
    failed = requests[requests["status"] != "ok"]
    if failed.empty:
        return ""
    row = failed.iloc[0]
    return f"{row['request_id']}: {row['error']}"
