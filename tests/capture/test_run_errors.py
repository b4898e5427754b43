"""Bad input to `kvscope run` gets a clear error and exit code 2, before or at server start."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
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
        "import kvscope.capture.workload.runner, kvscope.capture.workload.report; "
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
    models = _broken_twin(tmp_path)
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


def _broken_twin(tmp_path: Path) -> Path:
    """A models directory whose tiny twin vLLM cannot load: the server dies at start-up."""
    from kvscope.capture import twins

    models = tmp_path / "models"
    twins.make(twins.get("tiny"), models / "tiny")
    (models / "tiny" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    return models


def _server_left_running(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.root
def test_world_writable_kv_dir_is_refused(tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir()
    os.chmod(kv, 0o777)
    proc = kvscope_run("--model", "tiny", "--kv-dir", str(kv), "--out", str(tmp_path / "r"),
                       "--port", str(_free_port()))
    assert proc.returncode == 2
    assert f"KV directory {kv} has mode 0777 (group/world-writable)" in proc.stderr
    assert f"chmod 700 {kv}" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.root
def test_kv_dir_in_use_by_another_server_is_refused(tmp_path):
    from kvscope.patched_backend.parallel_disk.dirlock import DirectoryLock

    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    lock = DirectoryLock(str(kv)).acquire()
    try:
        proc = kvscope_run("--model", "tiny", "--kv-dir", str(kv), "--out", str(tmp_path / "r"),
                           "--port", str(_free_port()))
    finally:
        lock.release()
    assert proc.returncode == 2
    assert f"KV directory {kv} is in use by another kvscope server (pid {os.getpid()}" in (
        proc.stderr)


@pytest.mark.live
@pytest.mark.root
def test_run_deletes_only_what_it_created_in_the_users_kv_dir(tmp_path):
    """Issue 14 item 3: without --keep-kv the user's own files in --kv-dir survive the run."""
    models = _broken_twin(tmp_path)
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    (kv / "notes.txt").write_text("the user's own file")
    proc = kvscope_run("--model", "tiny", "--models-dir", str(models), "--port",
                       str(_free_port()), "--out", str(tmp_path / "r"), "--kv-dir", str(kv),
                       "--phases", "warm", timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert sorted(p.name for p in kv.iterdir()) == ["notes.txt"]
    assert (kv / "notes.txt").read_text() == "the user's own file"


def _start_run(tmp_path: Path, port: int, serving: bool = True) -> subprocess.Popen:
    """`kvscope run` of many warm requests, returned once its server answers /health, or, with
    `serving` False, once the API server, engine core and worker exist and before it answers."""
    import urllib.request

    log = open(tmp_path / "driver.log", "wb")
    driver = subprocess.Popen(
        [sys.executable, "-m", "kvscope.cli", "run", "--model", "tiny", "--phases", "warm",
         "--requests", "400", "--prompt-tokens", "600", "--port", str(port), "--no-probes",
         "--no-tracing", "--out", str(tmp_path / "r"), "--kv-dir", str(tmp_path / "kv")],
        stdout=log, stderr=log)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and driver.poll() is None:
        if not serving and len(_server_tree(driver)) >= 3:
            return driver
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                if serving:
                    return driver
                pytest.fail("the server answered before its tree was seen starting")
        except OSError:
            time.sleep(0.2)
    driver.kill()
    pytest.fail(f"the server never came up; see {tmp_path / 'driver.log'}")


def _server_tree(driver: subprocess.Popen) -> list:
    import psutil

    return psutil.Process(driver.pid).children(recursive=True)


def _left_alive(processes: list, timeout_s: float = 60.0) -> list:
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.live
@pytest.mark.root
@pytest.mark.parametrize(("sig", "serving"), [(signal.SIGTERM, True), (signal.SIGHUP, False)],
                         ids=["SIGTERM-serving", "SIGHUP-starting"])
def test_signal_to_kvscope_ends_the_whole_server_tree(tmp_path, sig, serving):
    """Issue 14 item 8: `kill <kvscope>` (or its terminal closing) leaves no API server, engine
    core or worker, whether the server is serving or still starting."""
    port = _free_port()
    driver = _start_run(tmp_path, port, serving)
    tree = _server_tree(driver)
    try:
        assert len(tree) >= 3, [p.cmdline()[:3] for p in tree]  # API server, engine, worker
        driver.send_signal(sig)
        assert driver.wait(timeout=120) == 128 + sig.value, (tmp_path / "driver.log").read_text()
        left = _left_alive(tree)
        assert not left, [(p.pid, p.cmdline()[:4]) for p in left]
        assert not _server_left_running(port)
    finally:
        for process in tree:
            with contextlib.suppress(Exception):
                process.kill()
        driver.kill()


@pytest.mark.live
@pytest.mark.root
def test_api_server_death_still_ends_its_engine_and_worker(tmp_path):
    """The API server killed alone: when kvscope stops, its orphans go too."""
    port = _free_port()
    driver = _start_run(tmp_path, port)
    tree = _server_tree(driver)
    try:
        api = [p for p in tree if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
        assert len(api) == 1
        api[0].kill()
        driver.wait(timeout=300)
        left = _left_alive(tree)
        assert not left, [(p.pid, p.cmdline()[:4]) for p in left]
    finally:
        for process in tree:
            with contextlib.suppress(Exception):
                process.kill()
        driver.kill()
