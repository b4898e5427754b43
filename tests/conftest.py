"""Fixtures every test area shares."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvscope.capture import twins


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


@pytest.fixture(autouse=True)
def _no_tracer_left_running():
    """A test that traced in this process (a hook calling runtime.get()) leaves no exporter
    process behind, nor its address in the environment every later server would inherit."""
    yield
    from kvscope.tracer import exporter_link, runtime

    runtime.reset()
    exporter_link.stop_started_here()


MODELS_DIR = Path(os.environ.get("KVSCOPE_MODELS_DIR", Path.home() / ".cache/kvscope/models"))


@pytest.fixture(scope="session")
def twin_dir():
    """`twin_dir(name)`: make (or reuse) a model twin by name and return its directory."""

    def make(name: str) -> Path:
        path, _ = twins.make(twins.get(name), MODELS_DIR / name)
        return path

    return make


NOBODY = 65534  # the attacker of the trust tests: a real second local user


@pytest.fixture
def as_nobody():
    """`as_nobody(*argv)`: run a command as uid/gid 65534 (check=True); skips without root."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second user needs root")

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                               "--clear-groups", *argv], check=True, capture_output=True,
                              text=True)
    return run


@pytest.fixture
def shared_tmp():
    """A world-writable sticky directory like /tmp, that the second user can reach, under a
    fresh root-owned 0755 directory in /tmp (removed at teardown)."""
    base = Path(tempfile.mkdtemp(prefix="kvscope-shared-"))
    base.chmod(0o755)
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    yield shared
    shutil.rmtree(base, ignore_errors=True)


_seconds_by_room: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Adds each test phase's time to its room (tests/<room>/...), for the closing table."""
    parts = Path(report.nodeid.split("::")[0]).parts
    room = parts[1] if len(parts) > 2 else "(top)"
    _seconds_by_room[room] = _seconds_by_room.get(room, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The suite's time by room, so CI's budget (45 min on a slow machine) is watched where it
    goes."""
    if not _seconds_by_room:
        return
    terminalreporter.section("time by room")
    for room, seconds in sorted(_seconds_by_room.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{room:<16} {seconds / 60:6.1f} min")
    terminalreporter.write_line(f"{'total':<16} {sum(_seconds_by_room.values()) / 60:6.1f} min")
