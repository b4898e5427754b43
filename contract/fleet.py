"""The fleet tables `kvscope analyze --out DIR RUN...` writes: every run's attribution rows with
labels saying where each request ran, and a summary per label value.

fleet_attribution.parquet: LABELS, then the attribution columns (docs/analysis.md).
fleet_summary.parquet: SUMMARY_COLUMNS, one row per (label, value), then the share of TTFT of
each component (`<component>_share`).
"""

from __future__ import annotations

ATTRIBUTION_FILE = "fleet_attribution.parquet"
SUMMARY_FILE = "fleet_summary.parquet"
PARTS_DIR = "parts"  # one attribution file per run, written by whichever worker analysed it
# run_id: the run directory's manifest run_id; server: the machine's hostname; device: the disk
# the KV cache was read from; backend: the storage profile (or LMCache config file); hour: the
# UTC hour of the request's arrival (ISO 8601)
LABELS = ("run_id", "server", "device", "backend", "hour")
GROUPS = ("server", "device", "backend", "hour")  # what the summary is per
SUMMARY_COLUMNS = ("by", "value", "runs", "requests", "ttft_p50_ms", "ttft_p90_ms",
                   "ttft_p99_ms")
