"""A user's own vLLM server: `python -m vllm.entrypoints.openai.api_server` on the tiny twin.

Started as a user would start it (their command line, LMCache configured by its config file
with the kvscope disk backend, tracing by environment variables), not by `kvscope run`. The
server inherits the test's environment plus `env`; it runs in its own process group, so
stopping it stops the API server, engine core and worker together.

    with user_server(tmp_path, env={"KVSCOPE_TRACING": "1"}) as server:
        response = complete(server, prompt_ids[0], headers={"traceparent": ...})
"""

from __future__ import annotations

import json
import os
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from kvscope.testkit.tracing import free_tcp_port

from kvscope.capture import twins
from kvscope.capture.workload import profiles, prompts
from kvscope.capture.workload.server import ServerConfig, VLLMServer

MODELS_DIR = Path(os.environ.get("KVSCOPE_MODELS_DIR", Path.home() / ".cache/kvscope/models"))
MODEL = "tiny"
MAX_MODEL_LEN = 2048


def tiny_model() -> Path:
    """The tiny twin's directory (made on first use)."""
    path, _ = twins.make(twins.get(MODEL), MODELS_DIR / MODEL)
    return path


def tiny_prompts(count: int, tokens: int = 600, seed: int = 0) -> list[list[int]]:
    """`count` distinct prompts of `tokens` token ids for the tiny twin."""
    return prompts.make_prompts(count, tokens, vocab_size=twins.get(MODEL).vocab_size, seed=seed)


@contextmanager
def user_server(workdir: Path, env: Mapping[str, str] | None = None,
                args: Sequence[str] = (), profile: str = "kvscope",
                startup_timeout_s: float = 600.0) -> Iterator[VLLMServer]:
    """A running server (healthy) whose log is `workdir/server.log` and KV dir `workdir/kv`;
    `env`: extra environment (e.g. KVSCOPE_TRACING=1); `args`: extra api_server arguments."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = ServerConfig(
        model_dir=tiny_model(), served_name=MODEL, port=free_tcp_port(), host="127.0.0.1",
        max_model_len=MAX_MODEL_LEN, kv_cache_gib=1,
        lmcache=profiles.get(profile).lmcache_config(workdir / "kv"),
        kv_transfer=profiles.KV_TRANSFER_CONFIG, log_path=workdir / "server.log",
        extra_env=dict(env or {}), extra_args=list(args))
    with VLLMServer(config, startup_timeout_s=startup_timeout_s) as server:
        yield server


def complete(server: VLLMServer, prompt: list[int] | str, max_tokens: int = 4,
             headers: Mapping[str, str] | None = None, logprobs: int = 1,
             timeout_s: float = 120.0) -> dict[str, Any]:
    """One greedy /v1/completions request with a plain HTTP client; the response's JSON."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": logprobs}
    request = urllib.request.Request(
        f"{server.base_url}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def tokens_and_logprobs(response: Mapping[str, Any]) -> tuple[list[str], list[float]]:
    """What a request returned, to compare servers: its tokens and their logprobs."""
    logprobs = response["choices"][0]["logprobs"]
    return list(logprobs["tokens"]), list(logprobs["token_logprobs"])
