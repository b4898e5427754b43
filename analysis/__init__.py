"""TTFT attribution from a run directory: pandas in, pandas out.

Public API (the dashboard and the kvscope commands use only these):
    load_run(path) -> Run          every table and span of a run, with its problems
    attribute(run) -> DataFrame    per-request TTFT split (docs/analysis.md lists the columns)
    summarize(run, attribution)    per-run percentiles, bandwidth, depth, findings (a dict)

Synthetic runs with known components, for tests and benches, are in kvscope.testkit.synthetic.
"""

from kvscope.analysis.attribution import COLUMNS, COMPONENTS, DEFAULT_PRIORITY, STORAGE_PARTS, attribute
from kvscope.analysis.run import Run, load_run
from kvscope.analysis.summary import summarize

__all__ = ["COLUMNS", "COMPONENTS", "DEFAULT_PRIORITY", "STORAGE_PARTS", "Run", "attribute",
           "load_run", "summarize"]
