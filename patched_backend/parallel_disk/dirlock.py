# SPDX-License-Identifier: Apache-2.0
"""One server per KV directory: an exclusive ``flock`` held for the backend's lifetime.

Why: each server indexes only its own writes (so two overshoot the capacity), one server's
start-up scan would delete the other's temporary files and move its chunks aside, and
telling a live writer's temporary file from a dead one's by pid breaks across containers.
``flock`` is released by the kernel when the holder dies (even SIGKILL), so a crashed server
never leaves the directory locked, and it works across pid namespaces on one host.
"""

import fcntl
import os
import socket
from typing import Optional

LOCK_NAME = ".kvscope.lock"


class DirectoryInUse(RuntimeError):
    """Another live process holds the KV directory's lock."""


class DirectoryLock:
    """``acquire()`` or DirectoryInUse naming the holder; ``release()`` (idempotent)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: Optional[int] = None

    def acquire(self) -> "DirectoryLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DirectoryInUse(
                f"KV directory {os.path.dirname(self.path)} is in use by another kvscope "
                f"server ({holder}); give each server its own kvscope.path") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None
