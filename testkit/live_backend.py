# SPDX-License-Identifier: Apache-2.0
"""Helpers for the live backend tests: drive ``kvscope run`` and inspect its chunk files."""

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from kvscope.capture import twins
from kvscope.capture.workload import profiles
from kvscope.capture.workload.server import ServerConfig, VLLMServer
from kvscope.contract import rundir
from kvscope.patched_backend.parallel_disk.chunkfile import (
    HEADER_SIZE, SUFFIX, TEMP_PREFIX, ChunkHeader, block_hashes, read_header,
)

CHUNK_TOKENS = 256
_FOUND = re.compile(r"kvscope disk backend at .*?(\d+) chunks \(\d+ bytes\) found on disk")


def run_argv(out: Path, kv_dir: Path, port: int, *options: str) -> list[str]:
    """argv of a ``kvscope run`` with the ``kvscope`` profile, no probes or tracing."""
    return [sys.executable, "-m", "kvscope.cli", "run", "--profile", "kvscope",
            "--out", str(out), "--kv-dir", str(kv_dir), "--keep-kv", "--port", str(port),
            "--no-probes", "--no-tracing", "--max-tokens", "4", *options]


def kvscope_run(out: Path, kv_dir: Path, port: int, *options: str) -> pd.DataFrame:
    """Run ``kvscope run`` to completion; its requests table (the run must succeed)."""
    proc = subprocess.run(run_argv(out, kv_dir, port, *options), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert rundir.validate(out) == []
    requests = rundir.read_table(out, "requests")
    assert requests is not None
    return requests


def chunks_found_at_start(run: Path) -> int:
    """Chunks the backend indexed from disk at start-up (its start-up log line)."""
    found = _FOUND.findall((run / "server.log").read_text(errors="replace"))
    assert len(found) == 1, "expected one 'kvscope disk backend at' line in server.log"
    return int(found[0])


def server_log(run: Path) -> str:
    """The run's server log."""
    return (run / "server.log").read_text(errors="replace")


def chunk_files(kv_dir: Path) -> list[Path]:
    """Published chunk files (not temporary or quarantined ones)."""
    return sorted(p for p in kv_dir.iterdir() if p.name.endswith(SUFFIX))


def temp_files(kv_dir: Path) -> list[Path]:
    """Temporary files of writes in progress (or of a writer that died)."""
    return [p for p in kv_dir.iterdir() if p.name.startswith(TEMP_PREFIX)]


def verify_file(path: Path) -> ChunkHeader:
    """Read a whole chunk file and check its header and every payload hash (AssertionError)."""
    header, _ = read_header(str(path))
    with open(path, "rb") as f:
        f.seek(HEADER_SIZE)
        payload = memoryview(bytearray(f.read(header.payload_len)))
    assert len(payload) == header.payload_len, f"{path} is short"
    assert block_hashes(payload, header.hash_block) == header.hashes, f"{path}: payload hash differs"
    return header


def hit_chunks(requests: pd.DataFrame) -> Any:
    """Chunks each request loaded: vLLM counts a full hit as one token less (it recomputes it)."""
    return -(-requests["cached_tokens"] // CHUNK_TOKENS)


def kill_server_group(driver_pid: int) -> int:
    """SIGKILL the vLLM server process group that the ``kvscope run`` driver started."""
    import signal

    import psutil

    for child in psutil.Process(driver_pid).children(recursive=True):
        if "vllm.entrypoints.openai.api_server" in " ".join(child.cmdline()):
            os.killpg(child.pid, signal.SIGKILL)  # the server runs in its own session
            return child.pid
    raise AssertionError(f"no vLLM server under kvscope run pid {driver_pid}")


def tiny_server(run: Path, kv: Path, port: int, block_size: Optional[int] = None) -> VLLMServer:
    """The vLLM OpenAI server as a user starts it by hand (``python -m
    vllm.entrypoints.openai.api_server ...``): tiny twin, LMCache with the ``kvscope`` profile on
    ``kv``, log in ``run/server.log``. Use as a context manager."""
    spec = twins.get("tiny")
    model_dir, _ = twins.make(spec, Path.home() / ".cache" / "kvscope" / "models" / "tiny")
    run.mkdir(parents=True, exist_ok=True)
    return VLLMServer(ServerConfig(
        model_dir=model_dir, served_name="tiny", port=port, host="127.0.0.1",
        max_model_len=1024, kv_cache_gib=1, lmcache=profiles.get("kvscope").lmcache_config(kv),
        kv_transfer=profiles.KV_TRANSFER_CONFIG, log_path=run / "server.log",
        extra_args=[] if block_size is None else ["--block-size", str(block_size)]))


def first_token(server: VLLMServer, prompt: list[int]) -> tuple[float, int]:
    """(logprob of the greedy first token, prompt tokens vLLM says came from the cache)."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                       "logprobs": 1}).encode()
    request = urllib.request.Request(f"{server.base_url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.load(response)
    details = reply["usage"].get("prompt_tokens_details") or {}
    return reply["choices"][0]["logprobs"]["token_logprobs"][0], details.get("cached_tokens", 0)
