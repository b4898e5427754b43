"""The CPU KV connector moves KV bit-exactly through real LMCache and a real disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvscope.capture.workload import profiles
from kvscope.patched_backend.parallel_disk.config import DELAY_ENV

HERE = Path(__file__).parent
LATE_DELAY_MS = 1000
pytestmark = pytest.mark.live


def _roundtrip(model_dir: Path, tmp_path: Path, tokens: int, profile: str,
               late_failure: bool) -> dict:
    kv_dir = tmp_path / "kv"
    config = profiles.get(profile).lmcache_config(kv_dir)
    (tmp_path / "lmcache.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "LMCACHE_CONFIG_FILE": str(tmp_path / "lmcache.yaml"),
           "VLLM_CPU_KVCACHE_SPACE": "3",
           # the worker extension's folder, before the checkout's root (a worktree's kvscope)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    if late_failure:  # every read slower than a scheduler step: chunks are handed out unread
        env[DELAY_ENV] = str(LATE_DELAY_MS)
    proc = subprocess.run(
        [sys.executable, str(HERE / "kv_roundtrip_main.py"), str(model_dir), str(kv_dir),
         str(tokens), "late-failure" if late_failure else "-"], env=env, capture_output=True,
        text=True, timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


# The serial mode's reads are bit-exact in tests/patched_backend/test_backend_engine.py (a real LMCache
# engine, both modes) and read every chunk cold live in tests/kvscope/test_study.py.
@pytest.mark.parametrize(("twin", "profile"), [
    ("qwen2.5-32b", "stock"),  # LMCache's own disk tier: the reference, the demo's geometry
    ("qwen2.5-32b", "kvscope"),  # the parallel-read backend
])
def test_kv_blocks_round_trip_bit_exact_through_lmcache_disk(twin, profile, twin_dir, tmp_path):
    pipelined = profile == "kvscope"
    result = _roundtrip(twin_dir(twin), tmp_path, tokens=512, profile=profile,
                        late_failure=pipelined)

    assert result["connector"] == "CPUPagedKVConnector"
    # kvscope's profile copies each chunk as soon as it is read (pipelined_connector.py)
    assert result["pipelined"] == pipelined
    assert result["differs_before"], "destination blocks must start different from the source"
    assert result["retrieved"] == 512
    assert result["equal_after"], f"KV bytes differ after the round trip: {result}"
    # The same prompt computed (miss) and loaded from disk (hit) gives the same tokens and
    # first-token distribution.
    assert result["miss_cached"] == 0 and result["hit_cached"] >= 256
    assert result["miss_tokens"] == result["hit_tokens"]
    assert result["miss_logprobs"].keys() == result["hit_logprobs"].keys()
    for token, logprob in result["miss_logprobs"].items():
        assert logprob == pytest.approx(result["hit_logprobs"][token], abs=2e-2)
    if pipelined:  # the hit's chunks were read ahead at the lookup and claimed
        stats = result["disk_stats"]
        assert stats["prefetch_claimed"] >= result["hit_cached"] // 256, stats
        # A chunk failing its check after the transfer took it (reads slowed to 1 s each) is
        # never copied: its blocks reach vLLM as load errors through the connector API and
        # vLLM recomputes them, so the answer is the computed one.
        assert stats["corrupt_by_reason"] == {"checksum": 1}, stats
        assert result["reported_blocks"] >= 256 // result["block_size"]
        assert result["failed_tokens"] == result["miss_tokens"]
        assert result["failed_logprobs"].keys() == result["miss_logprobs"].keys()
        for token, logprob in result["miss_logprobs"].items():
            assert logprob == pytest.approx(result["failed_logprobs"][token], abs=2e-2)
