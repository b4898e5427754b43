"""Bad input to `kvscope run` gets a clear error and exit code 2, before or at server start."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def kvscope_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvscope.cli", "run", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_unknown_twin_names_the_choices(tmp_path):
    proc = kvscope_run("--model", "gpt-17", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "unknown twin 'gpt-17'" in proc.stderr and "qwen2.5-32b" in proc.stderr


def test_context_over_the_model_limit(tmp_path):
    proc = kvscope_run("--model", "tiny", "--prompt-tokens", "5000", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "exceeds the tiny twin's context limit of 4096" in proc.stderr


def test_unknown_profile(tmp_path):
    proc = kvscope_run("--profile", "fastest", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2 and "unknown backend profile 'fastest'" in proc.stderr


@pytest.mark.root
def test_unwritable_kv_dir(tmp_path):
    proc = kvscope_run("--model", "tiny", "--kv-dir", "/proc/kvscope-kv", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "KV directory /proc/kvscope-kv is not writable" in proc.stderr


@pytest.mark.root
def test_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = kvscope_run("--model", "tiny", "--port", str(port), "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr


@pytest.mark.root
def test_not_root_when_the_page_cache_must_be_dropped(tmp_path):
    """The CLI really runs unprivileged: imports happen as root (the venv lives under /root),
    then the process drops to nobody before parsing and running."""
    code = (
        "import os, sys, locale, gettext; from kvscope import cli; "
        "import kvscope.workload.runner, kvscope.workload.report; "
        "parser = cli.build_parser(); os.setgid(65534); os.setuid(65534); "
        f"args = parser.parse_args(['run', '--model', 'tiny', '--out', '{tmp_path}/r']); "
        "sys.exit(args.func(args))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "drop the page cache" in proc.stderr and "needs root" in proc.stderr


@pytest.mark.live
@pytest.mark.root
def test_server_that_dies_at_start_shows_its_log(tmp_path):
    from kvscope import twins

    models = tmp_path / "models"
    twins.make(twins.get("tiny"), models / "tiny")
    (models / "tiny" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = kvscope_run("--model", "tiny", "--models-dir", str(models), "--port", str(port),
                       "--out", str(tmp_path / "r"), "--kv-dir", str(tmp_path / "kv"),
                       timeout=600)
    assert proc.returncode == 2
    assert "vLLM server exited with code" in proc.stderr
    assert "no-such-architecture" in proc.stderr, proc.stderr[-3000:]
    assert not _server_left_running(port)


def _server_left_running(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
