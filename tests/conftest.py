"""Fixtures every test area shares."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture
def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (one per live server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _no_inherited_prometheus_multiproc_dir(monkeypatch):
    """LMCache sets PROMETHEUS_MULTIPROC_DIR in whichever process builds an engine (the
    in-process backend tests do), and every server started later would inherit it and serve
    vLLM's multiprocess registry. Each test starts from a user's default; a test that wants the
    multiprocess registry sets it for its own server."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
