# SPDX-License-Identifier: Apache-2.0
"""Read knobs chosen from what the device does (``kvscope.tune: auto``, ``kvscope tune``).

No single read unit and depth suits every device and chunk size (upstream LMCache PR 5078 shows
it for its own reader), so they are measured on the chunk files themselves, O_DIRECT:

1. the ceiling: the best rate of a deep raw reader (rawread.py, at points of the device
   ceiling's sweep);
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
   by more than ``GROWTH`` over the depth kept (up to ``MAX_READERS``, and no more readers than
   the units a measurement reads: the rest would have nothing to read, so only noise would
   rank them; ``PATIENCE`` doublings without such a gain end it): its depth is where the rate
   stopped growing;
5. one read is a moment: on a shared machine one configuration's rate moves 10-25 % between
   reads seconds apart, as much as the candidates differ. So the search only picks finalists:
   each unit's depth and the depth read after it (or before, when it was the last), units whose
   search came within ``FINAL_MARGIN`` of the fastest. They are read again in ``FINAL_ROUNDS``
   rounds (each read holding at least a unit per reader), in turn, each round starting one
   finalist later (drift slows a round's reads alike, and none is always first), and ranked by
   the median of their rate over their round's median;
6. of the finalists within ``TOLERANCE`` of the best of that ranking, the one that spent the
   least CPU per byte wins, with its in-flight bytes. A server reads while its engine computes
   on the same cores: a reader's cycle is a cycle the prefill and the copies into the KV cache
   wait for, so among rates a quiet measurement cannot tell apart the cheaper one serves better
   (in two live runs side by side, 1 MiB x 16 had the slowest TTFT at c=16 of three knob sets
   whose reads moved within 12 % of each other, and the longest copies into the KV cache;
   docs/backend.md, "Tuning").

Every step is kept as a sentence (``Choice.reasons``) so ``kvscope tune`` can print why. The
reads are O_DIRECT, so the page cache neither helps them nor needs dropping; a server tunes at
start on the chunk files it found (4-11 s on the project VM), before it serves.
"""

import errno
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Optional, TypeVar

from kvscope.patched_backend.parallel_disk import rawread
from kvscope.patched_backend.parallel_disk.chunkfile import (
    HEADER_SIZE, ChunkHeader, CorruptChunk, file_size_for, hash64, padded, read_header)
from kvscope.patched_backend.parallel_disk.io_engine import ChunkRead, Identity, IOEngine, ReadBatch

UNITS = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
CEILING_POINTS = ((4 << 20, 32), (16 << 20, 8))
TOLERANCE = 0.05  # finalists' medians closer than this count as equal: the cheaper one wins
GROWTH = 0.03  # doubling the depth must gain more than this to be worth its threads
PATIENCE = 2  # doublings in a row without that gain that end a depth search
MAX_READERS = 64
MIN_BYTES = 256 << 20  # fewer chunk bytes than this on disk: nothing worth measuring
POINT_BYTES = 512 << 20  # bytes read per measurement at depth
ALONE_BYTES = 128 << 20  # bytes one reader reads alone per unit (its cycle time)
FINAL_ROUNDS = 5  # the median of five stands through two reads in slow moments
FINAL_MARGIN = 0.25  # a unit further behind the fastest in its search than one read's noise
FINAL_BYTES = 256 << 20  # per finalist a round (at least a unit per reader), read five times
# The largest payload a chunk file may claim: the reader allocates and touches what headers say
# (a file of ~POINT_BYTES and the largest chunk at most). The largest model's 256-token chunk is
# ~130 MiB (Llama 3.1 405B, bf16); a planted header claiming 6 GiB cost 6 GiB of memory.
MAX_CHUNK_BYTES = 1 << 30


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


class Reading(NamedTuple):
    """One measurement of the serving path: payload bytes per second, and the CPU time spent
    reading it per GB of payload (the reader threads', checksums included, and the submitter's)."""

    bytes_per_s: float
    cpu_s_per_gb: float


Reader = Callable[[list[Path], int, int], float]  # files, unit, depth -> bytes per second
PathMeasure = Callable[[list[Path], int, int], Reading]  # files, unit, depth -> a reading
T = TypeVar("T")
Point = tuple[int, int]  # read unit, readers
Steps = list[tuple[int, float]]  # a depth search's readers and rate, in the order read


def raw_reader(files: list[Path], unit: int, depth: int) -> float:
    """The raw O_DIRECT reader (rawread.py, the device ceiling's): no LMCache, no checks."""
    total, seconds = rawread.read_files(files, unit, depth)
    return total / seconds if seconds else 0.0


class PathReader:
    """Chunk files read the way the backend serves them: an ``IOEngine`` of ``depth`` reader
    threads, ``unit`` sub-reads, ``unit * depth`` bytes in flight, O_DIRECT into huge-page
    memory (LMCache's pool is collapsed to huge pages, buffers.py), each block's XXH3-64 checked
    when ``verify``. Payload bytes per second from submit to the last chunk's end, and the CPU
    time of the reader threads and of the submitting thread per GB of payload (not the whole
    process's: a server or a bench has other threads at work).

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

    def __call__(self, files: list[Path], unit: int, depth: int) -> Reading:
        headers = [self._header(f) for f in files]
        memory = self._buffer(sum(padded(h.payload_len) for h, _ in headers))
        engine = IOEngine(depth, unit, unit * depth, odirect=self.odirect)
        submitter_started = time.thread_time()
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
            cpu_s = engine.cpu_s() + time.thread_time() - submitter_started
        finally:
            engine.close()
        failed = next((c for c in chunks if c.error is not None), None)
        if failed is not None and failed.error is not None:
            raise OSError(errno.EIO, f"{failed.path}: {failed.error[0]}: {failed.error[1]}")
        seconds = max(batch.end_ns - batch.submit_ns, 1) / 1e9
        payload = sum(c.payload_len for c in chunks)
        return Reading(payload / seconds, cpu_s / payload * 1e9)

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
            self._memory = rawread.huge_buffer(nbytes)
        return self._memory


def hash_rate(nbytes: int = 64 << 20, in_cache: bool = False) -> float:
    """Bytes per CPU-second one reader verifies (XXH3-64 over 1 MiB blocks, as the engine does),
    over ``nbytes`` of memory, far more than the caches hold (where O_DIRECT data lands), or
    (``in_cache``) over one block again and again. CPU time: other work on the machine does not
    change it."""
    buf, block = rawread.huge_buffer(nbytes), 1 << 20
    started = time.thread_time()
    for offset in range(0, nbytes, block):
        hash64(buf[0:block] if in_cache else buf[offset:offset + block])
    return nbytes / max(time.thread_time() - started, 1e-9)


def choose(files: list[Path], chunk_bytes: int, device: Reader, path: PathMeasure) -> Choice:
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
        alone = path(few, unit, 1).bytes_per_s
        cycle = unit / alone
        readers = min(_most_readers(unit), max(2, math.ceil(best * cycle / unit)))
        reasons.append(
            f"{unit / mib:g} MiB: one reader alone reads and verifies one in "
            f"{cycle * 1e3:.1f} ms ({alone / 1e9:.2f} GB/s); {best / 1e9:.2f} GB/s x "
            f"{cycle * 1e3:.1f} ms = {best * cycle / mib:.0f} MiB in flight = {readers} readers")
        candidates.append((unit, readers))
    searches = {unit: _deepen(files, unit, readers, path, best, reasons)
                for unit, readers in candidates}
    points = _finalists(searches, reasons)
    readings = interleave(points, lambda unit, depth: path(
        _leading(files, max(FINAL_BYTES, unit * depth)), unit, depth), FINAL_ROUNDS)
    rounds = [{p: r.bytes_per_s for p, r in by_point.items()} for by_point in readings]
    score = scores(rounds)
    rates = {p: statistics.median(r[p] for r in rounds) for p in points}
    cpu = {p: statistics.median(r[p].cpu_s_per_gb for r in readings) for p in points}
    reasons.append(f"finals, {len(rounds)} rounds read in turn, each starting one later (the "
                   "round's median: " + ", ".join(
                       f"{statistics.median(r.values()) / 1e9:.2f}" for r in rounds)
                   + " GB/s); each one's median GB/s, share of its round's median, and CPU-s "
                   "per GB: " + ", ".join(
                       f"{_point(p)} {rates[p] / 1e9:.2f} ({score[p]:.2f}, {cpu[p]:.3f})"
                       for p in points))
    leader = max(points, key=lambda p: score[p])
    good = [p for p in points if score[p] >= (1 - TOLERANCE) * score[leader]]
    unit, readers = min(good, key=lambda p: (cpu[p], -p[0], p[1]))
    reasons.append(f"chosen: {unit / mib:g} MiB x {readers} readers, "
                   f"{unit * readers / mib:g} MiB in flight, {rates[unit, readers] / 1e9:.2f} "
                   f"GB/s, {rates[unit, readers] / best:.0%} of the ceiling, "
                   f"{cpu[unit, readers]:.3f} CPU-s/GB (the least CPU per GB of the "
                   f"{len(good)} within {TOLERANCE:.0%} of the finals' best, {_point(leader)})")
    return Choice(unit, readers, unit * readers, best, reasons)


def interleave(points: list[Point], read: Callable[[int, int], T],
               rounds: int) -> list[dict[Point, T]]:
    """Each of ``points`` read once a round by ``read`` (unit, readers -> its measurement),
    each round starting one point later than the one before: other work starting and stopping
    slows the reads of one round alike, and no point is always read first or last. The rates
    by round, in the order read."""
    measured = []
    for start in range(rounds):
        order = [points[(start + i) % len(points)] for i in range(len(points))]
        measured.append({p: read(*p) for p in order})
    return measured


def scores(rounds: list[dict[Point, float]]) -> dict[Point, float]:
    """Each point's median, over the rounds, of its rate over its round's median rate: how far
    ahead of the others it reads in the same moment. A round read while the machine was slow
    divides out, and the median ignores the reads (fewer than half) that landed in a moment of
    their own."""
    levels = [statistics.median(r.values()) for r in rounds]
    return {p: statistics.median(r[p] / level for r, level in zip(rounds, levels, strict=True))
            for p in rounds[0]}


def _finalists(searches: dict[int, tuple[Steps, int]], reasons: list[str]) -> list[Point]:
    """Each unit's depth kept and the one read after it (before it, when it was the last): one
    read each decided between them. Units whose depth kept read further behind the fastest than
    one read's noise (``FINAL_MARGIN``) are out."""
    fastest = max(steps[kept][1] for steps, kept in searches.values())
    points: list[Point] = []
    for unit, (steps, kept) in searches.items():
        if steps[kept][1] < (1 - FINAL_MARGIN) * fastest:
            reasons.append(f"{unit / (1 << 20):g} MiB is out: {steps[kept][1] / 1e9:.2f} GB/s, "
                           f"over {FINAL_MARGIN:.0%} behind the fastest, {fastest / 1e9:.2f}")
            continue
        near = kept + 1 if kept + 1 < len(steps) else kept - 1
        points += [(unit, steps[i][0]) for i in sorted({kept, near}) if i >= 0]
    return points


def _point(point: Point) -> str:
    return f"{point[0] / (1 << 20):g} MiB x {point[1]}"


def _deepen(files: list[Path], unit: int, readers: int, read: PathMeasure, best: float,
            reasons: list[str]) -> tuple[Steps, int]:
    """``unit`` read by ``read`` at ``readers``, then at twice as many while that still gains
    more than GROWTH over the depth kept; the search ends after ``PATIENCE`` doublings in a
    row without such a gain (one can land in a slow moment of a shared machine, and small gains
    add up). Every depth read with its rate, in order, and which of them was kept."""
    steps = [(readers, read(files, unit, readers).bytes_per_s)]
    kept, misses = 0, 0
    most = _most_readers(unit)
    while steps[-1][0] < most and misses < PATIENCE:
        probe = min(most, 2 * steps[-1][0])
        steps.append((probe, read(files, unit, probe).bytes_per_s))
        if steps[-1][1] > (1 + GROWTH) * steps[kept][1]:
            kept, misses = len(steps) - 1, 0
        else:
            misses += 1
    readers, rate = steps[kept]
    reasons.append(f"{unit / (1 << 20):g} MiB by readers (GB/s): "
                   + ", ".join(f"{d} {r / 1e9:.2f}" for d, r in steps)
                   + f"; {readers} readers, {rate / best:.0%} of the ceiling")
    return steps, kept


def _most_readers(unit: int) -> int:
    """Readers worth measuring for ``unit``: no more than the units a search point reads
    (``POINT_BYTES``; at 64 MiB, 8), as beyond that the extra readers wait for work that never
    comes and the rate differs by noise alone; never more than ``MAX_READERS``."""
    return min(MAX_READERS, max(1, POINT_BYTES // unit))


def chunk_files(directory: Path, limit_bytes: int = POINT_BYTES) -> tuple[list[Path], int]:
    """Chunk files of ``directory`` to measure on, the largest first, about ``limit_bytes``, and
    the largest one's padded payload; ([], 0) when they hold under MIN_BYTES. Only files whose
    header reads: a damaged chunk or one of another format is not served, so not measured.

    Raises:
        UnfitChunk: a chunk that would be measured claims more than it may (``_readable``).
    """
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


class UnfitChunk(ValueError):
    """A chunk file whose header claims more payload than ``MAX_CHUNK_BYTES``: one line naming
    the file."""


def _readable(path: Path) -> bool:
    """Whether ``path`` is a chunk the backend would serve as far as its header and size say:
    a damaged one, or one whose size is not its header's (the start-up scan's "truncated"),
    is not served, so not measured (and the raw reader reads files by their size).

    Raises:
        UnfitChunk: the header claims a payload over ``MAX_CHUNK_BYTES``, which the serving
            path's buffer would have to hold.
    """
    try:
        header, st = read_header(str(path))
    except (CorruptChunk, OSError):
        return False
    if header.payload_len > MAX_CHUNK_BYTES:
        raise UnfitChunk(f"{path}: its header claims a payload of {header.payload_len} bytes, "
                         f"over the {MAX_CHUNK_BYTES >> 20} MiB a chunk may hold; nothing was "
                         "read: move it out of the directory")
    return st.st_size == file_size_for(header.payload_len)


def _leading(files: list[Path], limit_bytes: int) -> list[Path]:
    chosen, total = [], 0
    for f in files:
        if total >= limit_bytes:
            break
        chosen.append(f)
        total += f.stat().st_size
    return chosen
