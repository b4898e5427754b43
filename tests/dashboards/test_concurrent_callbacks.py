"""Dash serves callbacks from threads: the page's first load builds every figure at once.

Plotly builds a template's shared defaults lazily and not thread safely (plotly.py issue
3441), which failed one callback in a few with ValueError("Invalid value"), a 500 in the
browser. It strikes only while those defaults are unbuilt, so each try is a fresh interpreter:
before the builders took one lock, 3 to 5 tries in 6 had an error (five run at once here)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

RACE = textwrap.dedent("""
    import sys, threading
    from kvscope.dashboards import callbacks, chunk_callbacks, data
    from kvscope.testkit import synthetic

    runs = data.load_runs([synthetic.make_run(sys.argv[1], n_requests=8, seed=1, nvme=True,
                                              ledger=True)])
    labels = list(runs)
    key = runs[labels[0]].attribution["key"].iloc[0]
    jobs = 3 * [lambda: callbacks.update_breakdown(runs, labels, "all", "TTFT"),
                lambda: callbacks.update_summary_views(runs, labels, "all"),
                lambda: callbacks.update_device(runs, labels),
                lambda: callbacks.update_nvme(runs, labels),
                lambda: chunk_callbacks.update_chunk_views(runs, labels, "all"),
                lambda: chunk_callbacks.update_chunk_strip(runs, key)]
    start, errors = threading.Barrier(len(jobs)), []

    def run(job):
        start.wait()
        try:
            job()
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("errors:", errors)
    sys.exit(1 if errors else 0)
""")


def test_every_callback_at_once_in_a_fresh_process_builds_its_figure(tmp_path):
    tries = [subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path / f"run{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(5)]
    for proc in tries:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-2000:] + err[-3000:]
