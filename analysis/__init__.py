"""The readers' room: everything kvscope concludes from a run directory, pandas in, pandas out.

Readers import only the contract and each other, so a run copied from another machine is read
with no vLLM, LMCache or BPF installed. What the other rooms call, by job:

    outputs      analyse a run once and write its outputs (attribution, summary, report), or
                 load them when they are current: the CLI, the dashboard and the study use this
    run, attribution, summary     load_run(path), attribute(run), summarize(run, attribution):
                 the three steps outputs runs, re-exported here for notebooks and tests
    compare, gate, acceptance     one run against another: deltas with intervals, CI gates
    ledger, readpath, findings, throughput, whatif     the questions a summary answers
    study_tables, study_verdict, study_targets, study_peers, study_repeats, study_report
                 a finished study; replicates: intervals across its repetitions and the rule
                 (ahead, behind, level, unknown spread) its headline and the gates share
    fleet, slices, parallel, spantable     many runs, long runs, and the span table's cache

Synthetic runs with known components, for tests and benches, are in kvscope.testkit.synthetic.
"""

from kvscope.analysis.attribution import COLUMNS, COMPONENTS, DEFAULT_PRIORITY, STORAGE_PARTS, attribute
from kvscope.analysis.run import Run, load_run
from kvscope.analysis.summary import summarize

__all__ = ["COLUMNS", "COMPONENTS", "DEFAULT_PRIORITY", "STORAGE_PARTS", "Run", "attribute",
           "load_run", "summarize"]
