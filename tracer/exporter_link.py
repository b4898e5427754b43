# SPDX-License-Identifier: Apache-2.0
"""A serving process's side of its server's exporter process: start it, hand it rings, keep it.

One exporter process per server. The first process that turns tracing on (vLLM's API server,
when vLLM loads its plugins, before it starts the engine core) starts it and puts its address
in the environment (ENV_EXPORTER), which vLLM's other processes inherit; every process
connects, says who it is, and hands over each ring's descriptor as its threads make them.

The address is an abstract Unix socket: there is no file another user could plant or that a
SIGKILL would leave behind. Each side checks the other's user (SO_PEERCRED): the exporter takes
rings only from its own user, and a process hands its rings only to an exporter of its own
user, so another user who takes the name first gets nothing and tracing stops, counted.

The process that started the exporter supervises it: when it dies, a new one starts at the same
address and every process's watcher thread reconnects and hands its rings over again. Records
still in a ring are not lost; what the dead exporter had taken and not exported is counted
lost (tracer/exporter.py), and the restart is counted as an `exporter.restart` error.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import multiprocessing.util
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from kvscope.contract.env import ENV_EXPORTER
from kvscope.tracer import config, failsafe
from kvscope.tracer.span_ring import Ring

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # a new exporter process imports the SDK first
RECONNECT_S = 30.0
EXIT_WAIT_S = 10.0  # the starter waits this long at exit for the exporter's last export
MAX_RESTARTS = 10  # an exporter that keeps dying is not started forever
EXIT_PRIORITY = 100  # multiprocessing finalizers with higher priority run first
MAX_MESSAGE = 4096
ACCEPTED = b'{"accepted": true}'  # the exporter's answer to a greeting it takes
_PEER = struct.Struct("3i")  # struct ucred: pid, uid, gid


class ExporterError(RuntimeError):
    """The exporter process could not be reached, or is not this user's."""


class OtherExporter(ExporterError):
    """No exporter at the inherited address, or one exporting elsewhere (another server's,
    whose address this process inherited): this process starts its own."""


def at_exit(close: Callable[[], None]) -> None:
    """Run `close` before this process goes away: at interpreter exit (atexit), and when a
    multiprocessing child (vLLM's engine core and workers) returns from its target, where
    atexit never runs."""
    atexit.register(close)
    multiprocessing.util.Finalize(None, close, exitpriority=EXIT_PRIORITY)


def peer_uid(sock: socket.socket) -> int:
    return _PEER.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER.size))[1]


def address(name: str) -> bytes:
    return b"\0" + name.encode()


class Supervisor:
    """Starts the exporter process and starts it again whenever it dies, until `stop`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.owner = os.getpid()
        self.stopping = False
        self.joined = False  # a process of this one's has linked to it
        self.process = self._spawn()
        threading.Thread(target=self._watch, name="kvscope-exporter-watch", daemon=True).start()

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "kvscope.tracer.exporter", self.name,
                                 str(self.owner)], stdin=subprocess.DEVNULL, close_fds=True)

    def _watch(self) -> None:
        for restarts in range(MAX_RESTARTS + 1):
            code = self.process.wait()
            if self.stopping or os.getpid() != self.owner:
                return
            if restarts == MAX_RESTARTS:
                failsafe.count("exporter.gave_up", ExporterError(
                    f"the exporter process died {restarts + 1} times"), fix="no new one is "
                    "started: spans stay in the rings, then are dropped and counted; restart "
                    "the server")
                return
            failsafe.count("exporter.restart", ExporterError(
                f"exporter process {self.process.pid} exited with status {code}"),
                fix="a new one was started; spans it had taken and not exported are counted "
                "lost in manifest.tracer")
            self.process = self._spawn()

    def stop(self, timeout_s: float) -> None:
        """The exporter exits once every process has closed its link; wait for that (one no
        process ever joined is told to go at once)."""
        self.stopping = True
        if not self.joined:
            self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("kvscope tracer: exporter process %d still exporting after %.0f s; "
                           "left to finish", self.process.pid, timeout_s)


_supervisor: list[Supervisor] = []


def start_if_first() -> str:
    """The address of this server's exporter, started here unless a parent process of the
    same configuration did (the address ends in its configuration's tag; the exporter checks
    the configuration itself when a process greets it)."""
    name = os.environ.get(ENV_EXPORTER, "")
    return name if name.endswith("-" + _tag()) else start_own()


def start_own() -> str:
    """Start an exporter process here and name it to the processes started after this."""
    name = f"kvscope-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}-{_tag()}"
    _supervisor.append(Supervisor(name))
    os.environ[ENV_EXPORTER] = name
    return name


def _tag() -> str:
    return hashlib.sha256(config.identity().encode()).hexdigest()[:12]


def stop_started_here() -> None:
    """Stop the exporters this process started and forget their address (at the last link's
    close, and in tests, which start tracers without serving)."""
    for supervisor in [s for s in _supervisor if s.owner == os.getpid()]:
        supervisor.stop(EXIT_WAIT_S)
        _supervisor.remove(supervisor)
        if os.environ.get(ENV_EXPORTER) == supervisor.name:  # a later tracer starts anew
            del os.environ[ENV_EXPORTER]


class Link:
    """This process's connection to the exporter, and every ring it has handed over."""

    def __init__(self, name: str, hello: dict[str, Any]) -> None:
        self.name = name
        self.hello = hello
        self.rings: list[Ring] = []
        self.sock: socket.socket | None = None
        self.closed = False
        self._lock = threading.Lock()
        self._linked = threading.Event()  # clear while the watcher reconnects

    @classmethod
    def join(cls, hello: dict[str, Any]) -> "Link":
        """This process's link to its server's exporter; to one of its own when the address it
        inherited has none, or one of another identity (config.identity: a server started by
        a traced process inherits that process's address, not its spans directory)."""
        hello = {**hello, "pid": os.getpid(), "config": config.identity()}
        link = cls(start_if_first(), hello)
        try:
            sock = link._connect(CONNECT_TIMEOUT_S)
        except OtherExporter as e:
            logger.info("kvscope tracer: pid %d starts an exporter of its own: %s", os.getpid(), e)
            link.name = start_own()
            sock = link._connect(CONNECT_TIMEOUT_S)
        link._attach(sock)
        for supervisor in _supervisor:
            supervisor.joined |= supervisor.name == link.name
        threading.Thread(target=link._watch, name="kvscope-exporter-link", daemon=True).start()
        return link

    def register(self, ring: Ring) -> None:
        """Hand `ring` to the exporter now, and again after every reconnection (never waits
        for a reconnection: the watcher sends it then)."""
        with self._lock:
            self.rings.append(ring)
            if self.sock is not None:
                self._send_ring(self.sock, ring)

    def _connect(self, timeout_s: float) -> socket.socket:
        """A connection to this user's exporter, greeted and accepted; tried again until
        `timeout_s` while there is none (or one dying as it answers); ExporterError when it is
        another user's, OtherExporter when there is none or it exports elsewhere."""
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                sock.connect(address(self.name))
                uid = peer_uid(sock)
                if uid != os.getuid():
                    raise ExporterError(f"the exporter socket @{self.name} belongs to uid {uid}, "
                                        f"not {os.getuid()}: refused")
                sock.settimeout(max(deadline - time.monotonic(), 1.0))
                sock.sendall(json.dumps({"hello": self.hello}).encode())
                answer = sock.recv(MAX_MESSAGE)
                sock.settimeout(None)
            except OSError as e:
                sock.close()
                if time.monotonic() > deadline:
                    raise OtherExporter(f"no exporter process answers at @{self.name} after "
                                        f"{timeout_s:.0f} s ({e})") from None
                time.sleep(0.05)
                continue
            except ExporterError:
                sock.close()
                raise
            if answer != ACCEPTED:
                sock.close()
                if not answer and time.monotonic() < deadline:  # closed as it died: again
                    time.sleep(0.05)
                    continue
                raise OtherExporter(f"the exporter at @{self.name} exports another "
                                    f"configuration's spans ({answer[:200]!r})")
            return sock

    def _attach(self, sock: socket.socket) -> None:
        """Use `sock` from now on, after handing it every ring made so far."""
        with self._lock:
            for ring in self.rings:
                self._send_ring(sock, ring)
            self.sock = sock
        self._linked.set()

    @staticmethod
    def _send_ring(sock: socket.socket, ring: Ring) -> None:
        try:
            socket.send_fds(sock, [b'{"ring": true}'], [ring.fd])
        except OSError:  # the exporter is gone: the watcher hands it over again
            pass

    def _watch(self) -> None:
        """Block until the exporter goes away, then reconnect to the one started again."""
        while True:
            sock = self.sock
            if sock is None:
                return
            try:
                sock.recv(MAX_MESSAGE)  # the exporter never writes: this returns at its end
            except OSError:
                pass
            with self._lock:
                if self.closed or os.getpid() != self.hello["pid"]:
                    return
                self.sock = None
                self._linked.clear()
            sock.close()
            try:
                self._attach(self._connect(RECONNECT_S))
            except ExporterError as e:
                failsafe.count("exporter.link", e, fix="spans of this process are no longer "
                               "exported; restart the server to trace again")
                return

    def close(self) -> None:
        """Say goodbye (the exporter drains this process's rings), then, in the process that
        started the exporter, wait for its last export. While the watcher is handing the rings
        to a restarted exporter, wait for that first, or their last records would be read by
        nobody."""
        self._linked.wait(CONNECT_TIMEOUT_S)
        with self._lock:
            if self.closed:
                return
            self.closed = True
            sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.sendall(b'{"bye": true}')
            except OSError:
                pass
            sock.close()
        stop_started_here()

    def abandon(self) -> None:
        """In a forked child: the parent's connection is the parent's (closed, no goodbye)."""
        self.closed = True
        if self.sock is not None:
            os.close(self.sock.detach())
        self.sock = None
