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

from kvscope.contract import files
from kvscope.contract.env import ENV_BACKEND_STATS_DIR
from kvscope.contract.env import ENV_SPANS_DIR, ENV_TRACING

LMCACHE_CONFIG_VARIABLE = "LMCACHE_CONFIG_FILE"
LMCACHE_CONFIG_MAX_BYTES = 1 << 20  # LMCache's YAML is a few dozen lines


class ServerNotFound(ValueError):
    """No vLLM server where the user pointed; the message says what to pass instead."""


@dataclass(frozen=True)
class ServingProcesses:
    """The API server's pid, every pid of its tree, the API server's environment, and the
    user it runs as (`uid`: the only owner whose files a recording takes from the server)."""

    api_pid: int
    pids: tuple[int, ...]
    environ: dict[str, str]
    cmdline: tuple[str, ...]
    uid: int

    @property
    def owners(self) -> frozenset[int]:
        """Who may own the directories a recording reads from this server: its user, root."""
        return frozenset({self.uid, 0})

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
        uid = api.uids().effective
    except psutil.NoSuchProcess:
        raise ServerNotFound(f"pid {pid}: no such process; pass the vLLM API server's pid") \
            from None
    except psutil.AccessDenied:
        raise ServerNotFound(f"pid {pid}: not allowed to read its environment; run kvscope "
                             "record as the server's user or as root") from None
    return ServingProcesses(pid, tuple(p.pid for p in tree), environ, tuple(cmdline), uid)


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


def lmcache_disk_paths(server: ServingProcesses, notes: list[str]) -> list[Path]:
    """The directories LMCache's disk tiers use, from the config file the server loaded
    (LMCACHE_CONFIG_FILE) or LMCache's environment variables: stock `local_disk` and kvscope's
    `kvscope.path`. The file is read as root may read what the server's user controls: a
    regular file of that user (or root), capped, and only the fields of the types LMCache
    takes; anything else adds a line to `notes` and is left out."""
    config = _lmcache_config(server, notes)
    local_disk = config.get("local_disk") or server.environ.get("LMCACHE_LOCAL_DISK")
    extra = config.get("extra_config")
    found = [local_disk.removeprefix("file://")] if isinstance(local_disk, str) else []
    if isinstance(extra, dict) and isinstance(extra.get("kvscope.path"), str):
        found.append(extra["kvscope.path"])
    return [Path(p) for p in found if p]


def _lmcache_config(server: ServingProcesses, notes: list[str]) -> dict[str, Any]:
    path = server.environ.get(LMCACHE_CONFIG_VARIABLE)
    if not path:
        return {}
    fix = "its KV directories are not probed unless given with --kv-dir"
    try:
        config = yaml.safe_load(files.read_bytes(path, LMCACHE_CONFIG_MAX_BYTES, server.owners))
    except (OSError, ValueError, yaml.YAMLError, RecursionError) as e:  # UnsafePath too
        notes.append(f"{LMCACHE_CONFIG_VARIABLE} {path}: not read ({_one_line(e)}); {fix}")
        return {}
    if config is None:
        return {}
    if not isinstance(config, dict):
        notes.append(f"{LMCACHE_CONFIG_VARIABLE} {path}: holds a YAML "
                     f"{type(config).__name__}, not a mapping; {fix}")
        return {}
    return config


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
