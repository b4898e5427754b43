# SPDX-License-Identifier: Apache-2.0
"""Live, issue 14 item 1: a restart with another ``--block-size`` on the same kvscope.path.

As a user would: the vLLM OpenAI server started directly (``python -m
vllm.entrypoints.openai.api_server ... --block-size 128``) with LMCache and the ``kvscope``
profile, on the tiny twin; one 600-token prompt is computed and stored; the server is
restarted with ``--block-size 32`` on the same directory. The tiny twin's greedy token barely
depends on the KV, so the first token's logprob is compared: the restarted server must give
what a recompute gives (the stored chunks of the other layout are refused, counted, and not
loaded), and its own chunks, loaded back, must give it again.
"""

import time
from pathlib import Path

import pytest

from kvscope.patched_backend.parallel_disk.chunkfile import read_header
from kvscope.testkit.live_backend import chunk_files, first_token, server_log, temp_files, tiny_server

pytestmark = [pytest.mark.live]

# A prefix hit computes the last tokens' attention over loaded KV instead of in one prefill pass;
# the sums run in another order and the logprob moves in its sixth digit (seen: 2.9e-6).
SUMMATION_NOISE = 1e-4
PROMPT = [(7 * i + 3) % 1000 + 1 for i in range(600)]  # two full 256-token chunks


def _wait_for_two_chunks(kv: Path, block_size: int) -> None:
    """Until both chunk files are published by a server with ``block_size``."""
    deadline = time.monotonic() + 120
    while True:
        files = [] if temp_files(kv) else chunk_files(kv)
        sizes = [read_header(str(f))[0].layout.get("block_size") for f in files]
        if sizes == [block_size, block_size]:
            return
        assert time.monotonic() < deadline, f"chunks of block size {block_size} not in {kv}"
        time.sleep(0.2)


def test_restart_with_another_block_size_serves_no_wrong_kv(tmp_path, free_port):
    kv = tmp_path / "kv"
    with tiny_server(tmp_path / "bs128", kv, free_port, 128) as server:
        computed_128, cached = first_token(server, PROMPT)
        assert cached == 0
        _wait_for_two_chunks(kv, 128)
        reloaded_128, cached = first_token(server, PROMPT)
        assert cached == 512  # same layout: the same KV, summed in another order on a hit
        assert reloaded_128 == pytest.approx(computed_128, abs=SUMMATION_NOISE)
    with tiny_server(tmp_path / "bs32", kv, free_port, 32) as server:
        after_restart, cached = first_token(server, PROMPT)
        log = server_log(tmp_path / "bs32")
        assert "2 chunk file(s) refused at start-up (layout)" in log, log[-3000:]
        assert "block_size 128 (engine 32)" in log
        assert cached == 0  # the other layout's chunks are misses: recomputed
        _wait_for_two_chunks(kv, 32)  # this layout's stores replaced the old files
        reloaded_32, cached = first_token(server, PROMPT)
    assert cached == 512
    assert after_restart == pytest.approx(computed_128, abs=2e-3), (after_restart, computed_128)
    assert reloaded_32 == pytest.approx(after_restart, abs=SUMMATION_NOISE)
