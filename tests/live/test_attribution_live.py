"""A known delay injected into every storage read moves the attributed storage component by it.

Two live runs of the same prompts on the `kvscope-serial` backend, one with
KVSCOPE_READ_DELAY_MS=D: in serial mode the backend sleeps D before each chunk's single read, so
each request's storage read grows by chunks x D and nothing else should. The delay is large next
to the scheduling jitter of a busy 2-core machine (a late wake-up adds a few ms, never removes any),
so every request must move by at least the delay and the median by the delay within 10%.
"""

from __future__ import annotations

import pytest

from kvscope import analysis
from kvscope.workload.runner import RunOptions, execute

pytestmark = [pytest.mark.live, pytest.mark.root]

DELAY_MS = 100
REQUESTS = 6
PROMPT_TOKENS = 600  # 2 full chunks per request


def _cold_attribution(out, port, tmp_path, delay_ms: int):
    run = execute(RunOptions(
        out=out, model="tiny", profile="kvscope-serial", requests=REQUESTS, concurrency=[1],
        prompt_tokens=PROMPT_TOKENS, port=port, kv_dir=tmp_path / f"kv-{delay_ms}",
        extra_env={"KVSCOPE_READ_DELAY_MS": str(delay_ms)}))
    loaded = analysis.load_run(run)
    rows = analysis.attribute(loaded)
    rows = rows[(rows["phase"] == "cold") & ~rows["partial"].astype(bool)]
    return loaded, rows.set_index("prompt_index")


def test_injected_read_delay_moves_storage_read_by_that_delay(twin_dir, free_port, tmp_path):
    twin_dir("tiny")
    _, base = _cold_attribution(tmp_path / "base", free_port, tmp_path, 0)
    slow_run, slow = _cold_attribution(tmp_path / "slow", free_port, tmp_path, DELAY_MS)
    assert len(base) == len(slow) == REQUESTS, "every cold request must be fully attributed"

    reads = slow_run.spans[slow_run.spans["name"] == "kvscope.storage.read"]
    chunks = reads.groupby("request_id")["attributes"].apply(
        lambda attrs: sum(int(a["kvscope.storage.chunks"]) for a in attrs))
    per_prompt = slow.join(chunks.rename("chunks"), on="request_id")["chunks"]
    assert (per_prompt == PROMPT_TOKENS // 256).all(), per_prompt.tolist()

    expected_ns = per_prompt * DELAY_MS * 1_000_000
    moved = slow["storage_read_ns"] - base["storage_read_ns"]
    assert (slow["storage_read_ns"] >= expected_ns).all(), (slow["storage_read_ns"].tolist(),
                                                             expected_ns.tolist())
    ratio = (moved / expected_ns).median()
    assert ratio == pytest.approx(1.0, abs=0.1), (moved.tolist(), expected_ns.tolist())
    # The sum stays exact, and the delay did not leak into the other components.
    parts = ["queueing_ns", "kv_lookup_ns", "storage_read_ns", "transfer_ns", "prefill_ns",
             "other_ns"]
    assert (slow[parts].sum(axis=1) == slow["ttft_ns"]).all()
    other_moved = (slow["ttft_ns"] - base["ttft_ns"] - moved).abs().median()
    assert other_moved < 0.5 * DELAY_MS * 1_000_000
