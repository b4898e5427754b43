"""The processes of a running vLLM server, and where its LMCache disk tier keeps the KV.

A vLLM OpenAI server is a process tree: the API server (it owns the HTTP port), its engine
core, and the engine's workers. The KV reads happen in the engine core or the workers, never
in the API server, so a probe must filter on the whole tree. The server's own environment
(read from /proc) says where its spans go and which LMCache config it loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import yaml

from kvscope.contract.env import ENV_BACKEND_STATS_DIR
from kvscope.contract.env import ENV_SPANS_DIR, ENV_TRACING

LMCACHE_CONFIG_VARIABLE = "LMCACHE_CONFIG_FILE"


class ServerNotFound(ValueError):
    """No vLLM server where the user pointed; the message says what to pass instead."""


@dataclass(frozen=True)
class ServingProcesses:
    """The API server's pid, every pid of its tree, and the API server's environment."""

    api_pid: int
    pids: tuple[int, ...]
    environ: dict[str, str]
    cmdline: tuple[str, ...]

    @property
    def spans_dir(self) -> Path | None:
        value = self.environ.get(ENV_SPANS_DIR)
        return Path(value) if value else None

    @property
    def backend_stats_dir(self) -> Path | None:
        value = self.environ.get(ENV_BACKEND_STATS_DIR)
        return Path(value) if value else None

    @property
    def tracing(self) -> bool:
        return self.environ.get(ENV_TRACING) == "1"


def find(pid: int | None = None, url: str | None = None) -> ServingProcesses:
    """The server by its API server's pid, or by the URL it listens on."""
    if pid is None:
        if url is None:
            raise ServerNotFound("say which server: --url http://HOST:PORT or --pid API_SERVER_PID")
        pid = listening_pid(url)
    try:
        api = psutil.Process(pid)
        tree = [api, *api.children(recursive=True)]
        environ = api.environ()
        cmdline = api.cmdline()
    except psutil.NoSuchProcess:
        raise ServerNotFound(f"pid {pid}: no such process; pass the vLLM API server's pid") \
            from None
    except psutil.AccessDenied:
        raise ServerNotFound(f"pid {pid}: not allowed to read its environment; run kvscope "
                             "record as the server's user or as root") from None
    return ServingProcesses(pid, tuple(p.pid for p in tree), environ, tuple(cmdline))


def listening_pid(url: str) -> int:
    """The pid of the process listening on `url`'s port (the API server)."""
    port = urlparse(url).port
    if port is None:
        raise ServerNotFound(f"--url {url}: no port in it; pass e.g. http://127.0.0.1:8000")
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        raise ServerNotFound(f"--url {url}: not allowed to list sockets; pass --pid, or run as "
                             "root") from None
    pids = {c.pid for c in connections
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    if len(pids) != 1:
        found = "no process" if not pids else f"processes {sorted(pids)}"
        raise ServerNotFound(f"--url {url}: {found} listening on port {port}; pass --pid "
                             "with the vLLM API server's pid")
    return pids.pop()


def lmcache_disk_paths(environ: dict[str, str]) -> list[Path]:
    """The directories LMCache's disk tiers use, from the config file the server loaded
    (LMCACHE_CONFIG_FILE) or LMCache's environment variables: stock `local_disk` and kvscope's
    `kvscope.path`."""
    config: dict[str, Any] = {}
    path = environ.get(LMCACHE_CONFIG_VARIABLE)
    if path:
        try:
            config = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError):
            config = {}
    local_disk = config.get("local_disk") or environ.get("LMCACHE_LOCAL_DISK")
    extra = config.get("extra_config") or {}
    found = [str(local_disk).removeprefix("file://")] if local_disk else []
    if extra.get("kvscope.path"):
        found.append(str(extra["kvscope.path"]))
    return [Path(p) for p in found]
