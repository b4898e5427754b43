"""The FUSE half of a device twin: one file, served from a sparse backing file, whose reads take
as long as a modelled device would.

A loop device in direct-I/O mode over this file turns each block request into one FUSE read, so
the latency model here is what the block layer (and kvscope's block probes on `loopN`) sees.
Run as its own process (`python -m kvscope.capture.device_twin_fuse ...`), in the foreground,
multi-threaded: libfuse hands each request to a worker thread, and a worker sleeping out its
latency releases the GIL, so up to `queue_depth` reads are in flight at once.

The model (reads only; writes go straight to the backing file, so filling the twin is quick):
a read takes at least `latency_s` (the device's fixed cost: a flash read, a network round
trip), and all reads share one channel of `bandwidth` bytes/s, reserved in arrival order. The
two overlap, as a device pipelines them, so one read at a time reaches `size / latency_s` and
many in flight reach `bandwidth`: the serial-against-parallel gap the seeds' NVMe showed. The
backing file is read with O_DIRECT inside that time, so the page cache never serves the twin;
the real disk's own time counts toward the model's, not on top of it (a profile slower than the
real disk is reproduced; a faster one is not).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import mmap
import os
import queue
import signal
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import mfusepy

FILE_NAME = "disk"  # the one file the daemon serves, at the mount's root
MAX_REQUEST = 1 << 20  # libfuse 3's largest read or write (256 pages)
ALIGN = 4096  # O_DIRECT buffer and offset alignment on the backing file
PR_SET_TIMERSLACK = 29  # prctl: a sleeping worker wakes within 1 ns of its deadline, not 50 µs
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Model:
    """What a read costs: a fixed latency and a share of one channel, at most `queue_depth` at
    once."""

    latency_s: float
    bandwidth: float  # bytes/s, all reads together
    queue_depth: int


class _Channel:
    """The shared channel: each read reserves `size / bandwidth` seconds of it, in arrival order,
    and is done when both its reservation and its fixed latency have passed.

    No lock: a threading.Lock here was where workers queued most (a holder waiting for the GIL
    blocks every other worker). `deadline` has no call and no loop between reading and writing
    `_free_at`, so CPython 3.11 does not switch threads inside it (the eval breaker is polled at
    calls and backward jumps only); were it to, one reservation would be lost: a read slightly
    early, never a wrong byte."""

    def __init__(self, model: Model) -> None:
        self._latency_s = model.latency_s
        self._seconds_per_byte = 1.0 / model.bandwidth
        self._free_at = 0.0

    def deadline(self, size: int, now: float) -> float:
        free_at = self._free_at
        free_at = (now if now > free_at else free_at) + size * self._seconds_per_byte
        self._free_at = free_at
        earliest = now + self._latency_s
        return earliest if earliest > free_at else free_at


class TwinFile(mfusepy.Operations):
    """One file, FILE_NAME, whose bytes are the backing file's; reads follow the model."""

    use_ns = True

    def __init__(self, backing: str, model: Model) -> None:
        self._fd = os.open(backing, os.O_RDWR | os.O_DIRECT)
        self._size = os.fstat(self._fd).st_size
        self._model = model
        self._channel = _Channel(model)
        self._buffers: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()

    def init_with_config(self, conn_info: Any, config_3: Any) -> None:
        # The loop device's direct reads reach FUSE as background requests, of which the kernel
        # keeps at most max_background in flight (12 by default) and queues the rest: the
        # model's queue depth, enforced where it costs no Python (a semaphore here did: its
        # condition lock, fought over by every worker, was most of the daemon's time).
        if conn_info is not None:
            conn_info.max_background = self._model.queue_depth
            conn_info.congestion_threshold = self._model.queue_depth

    def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path == "/" + FILE_NAME:
            return {"st_mode": stat.S_IFREG | 0o600, "st_nlink": 1, "st_size": self._size,
                    "st_blksize": ALIGN}
        raise mfusepy.FuseOSError(errno.ENOENT)

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", FILE_NAME]

    def open(self, path: str, flags: int) -> int:
        if path != "/" + FILE_NAME:
            raise mfusepy.FuseOSError(errno.ENOENT)
        return 0

    def read_buf(self, path: str, bufpp: Any, size: int, offset: int, fh: int) -> int:
        """Read into a buffer libfuse owns (it frees it after replying) before the wait, so the
        real disk's time is part of the modelled time and no byte is copied by Python (`read`
        returning bytes copied each twice and held the twin under 0.6 GB/s)."""
        if offset % ALIGN or size % ALIGN:
            raise mfusepy.FuseOSError(errno.EINVAL)
        deadline = self._channel.deadline(size, time.monotonic())
        vec = _mem_bufvec(size)
        try:
            got = os.preadv(self._fd, [(ctypes.c_char * size).from_address(vec.buf.mem)], offset)
        except OSError:
            _LIBC.free(vec.buf.mem)
            _LIBC.free(ctypes.addressof(vec))
            raise
        vec.buf.size = got
        ctypes.cast(bufpp, ctypes.POINTER(ctypes.c_void_p))[0] = ctypes.addressof(vec)
        wait = deadline - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return 0

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        if offset % ALIGN or len(data) % ALIGN:
            raise mfusepy.FuseOSError(errno.EINVAL)
        with self._buffer() as buffer:
            buffer[:len(data)] = data
            return os.pwrite(self._fd, memoryview(buffer)[:len(data)], offset)

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        os.fsync(self._fd)
        return 0

    @contextmanager
    def _buffer(self) -> Iterator[mmap.mmap]:
        """A page-aligned buffer (mmap is page-aligned) from a shared pool. Not one per thread:
        libfuse's workers are no Python threads, so ctypes gives each callback a fresh thread
        state and a threading.local would be rebuilt on every request."""
        try:
            buffer = self._buffers.get_nowait()
        except queue.Empty:
            buffer = mmap.mmap(-1, MAX_REQUEST)
        try:
            yield buffer
        finally:
            self._buffers.put(buffer)


class _Buf(ctypes.Structure):
    """libfuse's struct fuse_buf."""

    _fields_ = [("size", ctypes.c_size_t), ("flags", ctypes.c_int), ("mem", ctypes.c_void_p),
                ("fd", ctypes.c_int), ("pos", ctypes.c_int64)]


class _BufVec(ctypes.Structure):
    """libfuse's struct fuse_bufvec with its one buffer inline (mfusepy's declares a pointer
    there, which is not libfuse's layout)."""

    _fields_ = [("count", ctypes.c_size_t), ("idx", ctypes.c_size_t), ("off", ctypes.c_size_t),
                ("buf", _Buf)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.malloc.restype = ctypes.c_void_p
_LIBC.malloc.argtypes = [ctypes.c_size_t]
_LIBC.free.argtypes = [ctypes.c_void_p]
_LIBC.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]


def _mem_bufvec(size: int) -> _BufVec:
    """A malloc'd one-buffer bufvec over a page-aligned malloc'd buffer of `size` bytes (O_DIRECT
    needs the alignment); libfuse frees both after replying."""
    mem = ctypes.c_void_p()
    address = _LIBC.malloc(ctypes.sizeof(_BufVec))
    if not address or _LIBC.posix_memalign(ctypes.byref(mem), ALIGN, size):
        _LIBC.free(address)
        raise mfusepy.FuseOSError(errno.ENOMEM)
    vec = _BufVec.from_address(address)
    vec.count, vec.idx, vec.off = 1, 0, 0
    vec.buf.size, vec.buf.flags, vec.buf.mem, vec.buf.fd, vec.buf.pos = size, 0, mem.value, -1, 0
    return vec


def _prctl(option: int, value: int) -> None:
    _LIBC.prctl(option, value, 0, 0, 0)


def serve(backing: str, mountpoint: str, model: Model) -> None:
    """Serve until unmounted or sent SIGTERM (libfuse's handler ends the loop and unmounts).
    SIGTERM also comes when the parent (device_twin's supervisor) dies, so a daemon never
    outlives the process that tears its loop device down. Workers inherit the timer slack."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(PR_SET_TIMERSLACK, 1)
    workers = model.queue_depth + 4  # libfuse 3.12+ caps its workers at 10 unless told
    mfusepy.FUSE(TwinFile(backing, model), mountpoint, foreground=True, nothreads=False,
                 direct_io=True, max_threads=workers, max_idle_threads=workers,
                 fsname="kvscope-twin")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("backing")
    parser.add_argument("mountpoint")
    parser.add_argument("--latency-us", type=float, required=True)
    parser.add_argument("--bandwidth", type=float, required=True, help="bytes/s")
    parser.add_argument("--queue-depth", type=int, required=True)
    args = parser.parse_args(argv)
    serve(args.backing, args.mountpoint,
          Model(args.latency_us / 1e6, args.bandwidth, args.queue_depth))


if __name__ == "__main__":
    main()
