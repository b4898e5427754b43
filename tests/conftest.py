"""Fixtures every test area shares."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest


@pytest.fixture
def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (one per live server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tmpfs(tmp_path):
    """`tmpfs(size)`: a size-limited tmpfs (mode 0700) under tmp_path (real ENOSPC), unmounted
    at teardown; skips the test without root."""
    mounted = []

    def mount(size: str = "3m"):
        if os.geteuid() != 0:
            pytest.skip("mounting a size-limited tmpfs needs root")
        mnt = tmp_path / f"tmpfs-{len(mounted)}"
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                        str(mnt)], check=True)
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(autouse=True)
def _no_inherited_prometheus_multiproc_dir(monkeypatch):
    """LMCache sets PROMETHEUS_MULTIPROC_DIR in whichever process builds an engine (the
    in-process backend tests do), and every server started later would inherit it and serve
    vLLM's multiprocess registry. Each test starts from a user's default; a test that wants the
    multiprocess registry sets it for its own server."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
