"""The human report of `kvscope analyze`: report.md with PNG plots in RUN/plots/.

The only module of the package that draws; it reads the attribution and summary it is given
and never recomputes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from kvscope.analysis.attribution import BATCH_PARTS, COMPONENTS, STORAGE_PARTS
from kvscope.contract import files


def write(path: Path, attribution: pd.DataFrame, summary: dict[str, Any]) -> Path:
    """Write RUN/report.md and RUN/plots/*.png; return the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    plots = files.private_dir(path / "plots")
    complete = attribution[~attribution["partial"].astype(bool)]
    names = [_breakdown_plot(complete, plots), _cdf_plot(complete, plots),
             _depth_plot(summary, plots)]
    lines = [f"# TTFT attribution: {summary['run_id']}", "", _counts(summary), ""]
    lines += _group_table(summary) + [""] + _throughput_table(summary) + [""]
    lines += _ledger_table(summary) + _findings(summary) + [""]
    lines += [f"![{n}](plots/{n}.png)" for n in names if n]
    report = path / "report.md"
    files.atomic_write(report, "\n".join(lines) + "\n")
    return report


def _counts(summary: dict[str, Any]) -> str:
    r = summary["requests"]
    return (f"{r['total']} requests: {r['complete']} complete, {r['partial']} partial "
            f"(left out of the numbers below), {r['failed']} failed.")


def _group_table(summary: dict[str, Any]) -> list[str]:
    parts = ("ttft", *COMPONENTS, *STORAGE_PARTS, *BATCH_PARTS)
    lines = ["| phase | conc | n | " + " | ".join(f"{p} p50 (ms)" for p in parts) + " |",
             "|---|---|---|" + "---|" * len(parts)]
    for g in summary["groups"]:
        cells = [f"{g['percentiles_ns'][p].get('p50', float('nan')) / 1e6:.1f}" for p in parts]
        lines.append(f"| {g['phase']} | {g['concurrency']} | {g['requests']} | " + " | ".join(cells) + " |")
    return lines


def _throughput_table(summary: dict[str, Any]) -> list[str]:
    """Requests/s, prompt tokens/s served from storage and output tokens/s per phase."""
    rows = summary.get("throughput") or []
    if not rows:
        return []
    lines = ["## Throughput per phase", "",
             "| phase | conc | requests | wall (s) | requests/s | prompt tokens/s from storage "
             "| output tokens/s | mean in flight |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['concurrency']} | {r['requests']} | {r['wall_s']:.2f} "
                     f"| {r['requests_per_s'] or 0:.2f} | {r['storage_tokens_per_s'] or 0:.0f} "
                     f"| {r['output_tokens_per_s'] or 0:.1f} | {r['mean_in_flight'] or 0:.1f} |")
    return lines


def _ledger_table(summary: dict[str, Any]) -> list[str]:
    """Per-tier hit rates and the miss reasons with their TTFT cost (the chunk ledger)."""
    return [*ledger_lines(summary.get("chunk_ledger")), ""] if summary.get("chunk_ledger") else []


def ledger_lines(ledger: dict[str, Any] | None) -> list[str]:
    """The chunk ledger as markdown: tiers, then miss reasons (also what `kvscope analyze`
    prints)."""
    if not ledger:
        return []
    rate = ledger["hit_rate"]
    lines = ["## Chunk ledger", "",
             f"{ledger['tokens']} looked-up tokens in {ledger['chunks']} chunks of "
             f"{ledger['requests']} requests; hit "
             f"{'-' if rate is None else f'{rate * 100:.1f} %'}", "",
             "| tier | chunks | tokens | hit rate |", "|---|---|---|---|"]
    for tier, t in ledger["tiers"].items():
        share = "-" if t["hit_rate"] is None else f"{t['hit_rate'] * 100:.1f} %"
        lines.append(f"| {tier} | {t['chunks']} | {t['tokens']} | {share} |")
    if ledger["misses"]:
        lines += ["", "| miss reason | chunks | tokens | share of missed | TTFT cost (s) | "
                  "top detail |", "|---|---|---|---|---|---|"]
        for m in ledger["misses"]:
            cost = "-" if m["ttft_cost_s"] is None else f"{m['ttft_cost_s']:.3f}"
            share = "-" if m["share_of_missed"] is None else f"{m['share_of_missed'] * 100:.1f} %"
            detail = next(iter(m["details"]), "")
            lines.append(f"| {m['reason']} | {m['chunks']} | {m['tokens']} | {share} | {cost} | "
                         f"{detail} |")
    return lines


def _findings(summary: dict[str, Any]) -> list[str]:
    if not summary["findings"]:
        return ["No findings."]
    return ["## Findings", ""] + [f"- **{f['severity']}** `{f['id']}`: {f['message']}"
                                  for f in summary["findings"]]


def _breakdown_plot(complete: pd.DataFrame, plots: Path) -> str | None:
    import matplotlib.pyplot as plt

    if complete.empty:
        return None
    means = complete.groupby(["phase", "concurrency"])[[f"{c}_ns" for c in COMPONENTS]].mean() / 1e6
    means.columns = list(COMPONENTS)
    ax = means.plot.barh(stacked=True, figsize=(8, 1.5 + 0.5 * len(means)))
    ax.set_xlabel("mean TTFT (ms)")
    ax.set_title("Where TTFT goes (exclusive time per component)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    plt.tight_layout()
    with files.atomic_writer(plots / "breakdown.png") as f:
        plt.savefig(f, format="png", dpi=100)
    plt.close("all")
    return "breakdown"


def _cdf_plot(complete: pd.DataFrame, plots: Path) -> str | None:
    import matplotlib.pyplot as plt

    if complete.empty:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for phase, group in complete.groupby("phase"):
        values = (group["ttft_ns"].astype("float64") / 1e9).sort_values()
        ax.step(values, [i / len(values) for i in range(1, len(values) + 1)], label=str(phase))
    return _save(fig, ax, "TTFT (s)", "fraction of requests", plots / "ttft_cdf.png")


def _depth_plot(summary: dict[str, Any], plots: Path) -> str | None:
    import matplotlib.pyplot as plt

    if not summary["queue_depth"]:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for d in summary["queue_depth"]:
        depths = sorted(d["histogram"], key=int)
        ax.bar([int(k) for k in depths], [d["histogram"][k] for k in depths], alpha=0.6,
               label=f"{d['device']} ({d['source']})")
    return _save(fig, ax, "requests in flight", "fraction of time", plots / "queue_depth.png")


def _save(fig: Any, ax: Any, xlabel: str, ylabel: str, path: Path) -> str:
    """Label, lay out, write and close a plot; returns its name for the report."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    with files.atomic_writer(path) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return path.stem
