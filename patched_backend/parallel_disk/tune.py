# SPDX-License-Identifier: Apache-2.0
"""Read knobs chosen from what the device does (``kvscope.tune: auto``, ``kvscope tune``).

No single read unit and depth suits every device and chunk size (upstream LMCache PR 5078 shows
it for its own reader), so they are measured on the chunk files themselves, O_DIRECT:

1. the ceiling: the best rate of a deep raw reader (points of capture/ceiling.py's sweep);
2. everything else is read by the serving path itself (``PathReader``: io_engine's reader
   threads, O_DIRECT into huge-page memory like LMCache's pool, every block's checksum checked
   as configured): a bare preadv loop keeps the device busy with fewer threads than readers that
   also verify, open, account and wake each other (3 MiB chunks on the virtio disk: 1 MiB x 4
   was enough for the raw reader and 0.77x of the best hand-set knobs in the backend);
3. one reader alone takes C(u) to read and verify a unit u; Little's law: to move X bytes/s,
   X * C(u) bytes must be in flight, readers = ceil(X * C(u) / u). That is where the search
   starts, not where it ends: a read alone is served faster than the same read among many (the
   device works on only so many at once, the rest queue);
4. each candidate unit is read at that depth, then at twice the depth while the rate still grows
   by more than ``GROWTH`` over the depth kept (up to ``MAX_READERS``; ``PATIENCE`` doublings
   without such a gain end it): its depth is where the rate stopped growing;
5. the first ceiling point is read again: how far it moved is the machine's drift while it was
   measured; the largest unit within ``TOLERANCE`` (or that drift, if larger) of the best rate
   seen (ceiling or candidate) wins (fewer, larger reads: fewer wake-ups and less work per
   byte), its readers and in-flight bytes with it; when no candidate comes that close to a
   ceiling measured in a faster moment (or one the verifying path cannot reach on these cores),
   the largest unit within that of the fastest candidate.

Every step is kept as a sentence (``Choice.reasons``) so ``kvscope tune`` can print why. The
reads are O_DIRECT, so the page cache neither helps them nor needs dropping; a server tunes at
start on the chunk files it found (a few seconds), before it serves.
"""

# Standard
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional
import errno
import math
import time

# First Party
from kvscope.capture import ceiling
from kvscope.patched_backend.parallel_disk.chunkfile import (
    HEADER_SIZE, ChunkHeader, CorruptChunk, hash64, padded, read_header)
from kvscope.patched_backend.parallel_disk.io_engine import ChunkRead, Identity, IOEngine, ReadBatch

UNITS = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
CEILING_POINTS = ((4 << 20, 32), (16 << 20, 8))
TOLERANCE = 0.03  # the sweep's own repeat-to-repeat noise on a quiet disk (at least)
GROWTH = 0.03  # doubling the depth must gain more than this to be worth its threads
PATIENCE = 2  # doublings in a row without that gain that end a depth search
MAX_READERS = 64
MIN_BYTES = 256 << 20  # fewer chunk bytes than this on disk: nothing worth measuring
POINT_BYTES = 512 << 20  # bytes read per measurement at depth
ALONE_BYTES = 128 << 20  # bytes one reader reads alone per unit (its cycle time)


@dataclass(frozen=True)
class Choice:
    """The knobs and why: ``reasons`` is the measurement, one sentence a step."""

    read_unit: int
    queue_depth: int
    max_inflight_bytes: int
    ceiling_bytes_per_s: float
    reasons: list[str] = field(default_factory=list)

    def knobs(self) -> dict[str, int]:
        return {"read_unit": self.read_unit, "queue_depth": self.queue_depth,
                "max_inflight_bytes": self.max_inflight_bytes}


Reader = Callable[[list[Path], int, int], float]  # files, unit, depth -> bytes per second


def raw_reader(files: list[Path], unit: int, depth: int) -> float:
    """The raw O_DIRECT reader of capture/ceiling.py (no LMCache, no checks): the ceiling."""
    return ceiling.read_files(files, unit, depth).bytes_per_s


class PathReader:
    """Chunk files read the way the backend serves them: an ``IOEngine`` of ``depth`` reader
    threads, ``unit`` sub-reads, ``unit * depth`` bytes in flight, O_DIRECT into huge-page
    memory (LMCache's pool is collapsed to huge pages, buffers.py), each block's XXH3-64 checked
    when ``verify``. Payload bytes per second from submit to the last chunk's end.

    The memory is one buffer as large as the most files read, touched when made and kept
    between measurements, so none of them pays for faulting it in.

    Raises:
        OSError: a file is unreadable, or a chunk failed (gone, replaced, checksum): a
            measurement of a path that did not read everything would be wrong.
    """

    def __init__(self, verify: bool = True, odirect: bool = True) -> None:
        self.verify, self.odirect = verify, odirect
        self._memory: Optional[memoryview] = None
        self._headers: dict[Path, tuple[ChunkHeader, Identity]] = {}

    def __call__(self, files: list[Path], unit: int, depth: int) -> float:
        headers = [self._header(f) for f in files]
        memory = self._buffer(sum(padded(h.payload_len) for h, _ in headers))
        engine = IOEngine(depth, unit, unit * depth, odirect=self.odirect)
        try:
            chunks: list[ChunkRead] = []
            offset = 0
            for path, (header, identity) in zip(files, headers, strict=True):
                size = padded(header.payload_len)
                chunks.append(ChunkRead(header.key, str(path), header.payload_len,
                                        memory[offset:offset + size],
                                        header.hashes if self.verify else None,
                                        header.hash_block, identity))
                offset += size
            batch = ReadBatch(chunks)
            engine.submit(batch)
            batch.wait()
        finally:
            engine.close()
        failed = next((c for c in chunks if c.error is not None), None)
        if failed is not None and failed.error is not None:
            raise OSError(errno.EIO, f"{failed.path}: {failed.error[0]}: {failed.error[1]}")
        seconds = max(batch.end_ns - batch.submit_ns, 1) / 1e9
        return sum(c.payload_len for c in chunks) / seconds

    def _header(self, path: Path) -> tuple[ChunkHeader, Identity]:
        if path not in self._headers:
            try:
                header, st = read_header(str(path))
            except CorruptChunk as exc:
                raise OSError(errno.EIO, f"{path}: {exc}") from None
            self._headers[path] = header, (st.st_dev, st.st_ino, st.st_size)
        return self._headers[path]

    def _buffer(self, nbytes: int) -> memoryview:
        if self._memory is None or len(self._memory) < nbytes:
            self._memory = None  # the old one goes before the new one is touched
            self._memory = ceiling.huge_buffer(nbytes)
        return self._memory


def hash_rate(nbytes: int = 64 << 20, in_cache: bool = False) -> float:
    """Bytes per CPU-second one reader verifies (XXH3-64 over 1 MiB blocks, as the engine does),
    over ``nbytes`` of memory, far more than the caches hold (where O_DIRECT data lands), or
    (``in_cache``) over one block again and again. CPU time: other work on the machine does not
    change it."""
    buf, block = ceiling.huge_buffer(nbytes), 1 << 20
    started = time.thread_time()
    for offset in range(0, nbytes, block):
        hash64(buf[0:block] if in_cache else buf[offset:offset + block])
    return nbytes / max(time.thread_time() - started, 1e-9)


def choose(files: list[Path], chunk_bytes: int, device: Reader, path: Reader) -> Choice:
    """Measure on ``files`` (chunk payloads of ``chunk_bytes``, padded) and choose: the ceiling
    with ``device`` (a raw reader), every candidate with ``path`` (the serving path).

    A unit never exceeds a chunk: the engine reads each chunk on its own."""
    mib = 1 << 20
    few = _leading(files, ALONE_BYTES)
    reasons = []
    deep = {(u, d): device(files, u, d) for u, d in CEILING_POINTS}
    best = max(deep.values())
    reasons.append("ceiling (raw reader): "
                   + ", ".join(f"{u // mib} MiB x {d} {r / 1e9:.2f} GB/s"
                               for (u, d), r in deep.items())
                   + f"; the best, {best / 1e9:.2f} GB/s, is the target")
    units = sorted({min(u, chunk_bytes) for u in UNITS})
    candidates = []
    for unit in units:
        alone = path(few, unit, 1)
        cycle = unit / alone
        readers = min(MAX_READERS, max(2, math.ceil(best * cycle / unit)))
        reasons.append(
            f"{unit / mib:g} MiB: one reader alone reads and verifies one in "
            f"{cycle * 1e3:.1f} ms ({alone / 1e9:.2f} GB/s); {best / 1e9:.2f} GB/s x "
            f"{cycle * 1e3:.1f} ms = {best * cycle / mib:.0f} MiB in flight = {readers} readers")
        candidates.append((unit, readers))
    measured = []
    for unit, readers in candidates:
        readers, rate = _deepen(files, unit, readers, path, best, reasons)
        measured.append((unit, readers, rate))
    tolerance = _tolerance(files, device, deep, reasons)
    fastest = max(m[2] for m in measured)
    top = max(best, fastest)
    why = f"the largest unit within {tolerance:.0%} of the best rate, {top / 1e9:.2f} GB/s"
    good = [m for m in measured if m[2] >= (1 - tolerance) * top]
    if not good:  # a ceiling measured in a faster moment, or one verifying readers cannot reach
        why = (f"none came within {tolerance:.0%} of the ceiling: the largest unit within "
               f"{tolerance:.0%} of the fastest, {fastest / 1e9:.2f} GB/s")
        good = [m for m in measured if m[2] >= (1 - tolerance) * fastest]
    unit, readers, rate = max(good, key=lambda m: (m[0], -m[1]))
    reasons.append(f"chosen: {unit / mib:g} MiB x {readers} readers, "
                   f"{unit * readers / mib:g} MiB in flight, {rate / 1e9:.2f} GB/s ({why})")
    return Choice(unit, readers, unit * readers, best, reasons)


def _tolerance(files: list[Path], device: Reader, deep: dict[tuple[int, int], float],
               reasons: list[str]) -> float:
    """How far apart two rates may be and still count as equal: TOLERANCE, or more when the
    first ceiling point, read again after the candidates, moved further (a shared machine
    drifting while it was measured: within that, the larger unit's fewer reads win)."""
    (unit, depth), first = next(iter(deep.items()))
    again = device(files, unit, depth)
    drift = abs(again - first) / max(again, first, 1.0)
    reasons.append(f"ceiling again, {unit >> 20} MiB x {depth}: {again / 1e9:.2f} GB/s, "
                   f"{drift:.0%} from the first")
    return max(TOLERANCE, drift)


def _deepen(files: list[Path], unit: int, readers: int, read: Reader, best: float,
            reasons: list[str]) -> tuple[int, float]:
    """``unit`` read by ``read`` at ``readers``, then at twice as many while that still gains
    more than GROWTH over the depth kept; the search ends after ``PATIENCE`` doublings in a
    row without such a gain (one can land in a slow moment of a shared machine, and small gains
    add up). The depth kept and its rate."""
    mib = 1 << 20
    rate = read(files, unit, readers)
    steps = [f"{readers} {rate / 1e9:.2f}"]
    probe, misses = readers, 0
    while probe < MAX_READERS and misses < PATIENCE:
        probe = min(MAX_READERS, 2 * probe)
        probe_rate = read(files, unit, probe)
        steps.append(f"{probe} {probe_rate / 1e9:.2f}")
        if probe_rate > (1 + GROWTH) * rate:
            readers, rate, misses = probe, probe_rate, 0
        else:
            misses += 1
    reasons.append(f"{unit / mib:g} MiB by readers (GB/s): {', '.join(steps)}; "
                   f"{readers} readers, {rate / best:.0%} of the ceiling")
    return readers, rate


def chunk_files(directory: Path, limit_bytes: int = POINT_BYTES) -> tuple[list[Path], int]:
    """Chunk files of ``directory`` to measure on, the largest first, about ``limit_bytes``, and
    the largest one's padded payload; ([], 0) when they hold under MIN_BYTES. Only files whose
    header reads: a damaged chunk or one of another format is not served, so not measured."""
    files = [f for f in sorted(Path(directory).glob("*.kvc"), key=lambda f: -f.stat().st_size)
             if f.is_file() and not f.is_symlink()]
    chosen, total = [], 0
    for f in files:
        if total >= limit_bytes:
            break
        if _readable(f):
            chosen.append(f)
            total += f.stat().st_size
    if total < MIN_BYTES:
        return [], 0
    return chosen, chosen[0].stat().st_size - HEADER_SIZE


def _readable(path: Path) -> bool:
    try:
        read_header(str(path))
    except (CorruptChunk, OSError):
        return False
    return True


def _leading(files: list[Path], limit_bytes: int) -> list[Path]:
    chosen, total = [], 0
    for f in files:
        if total >= limit_bytes:
            break
        chosen.append(f)
        total += f.stat().st_size
    return chosen
