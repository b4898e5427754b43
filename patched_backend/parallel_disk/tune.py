# SPDX-License-Identifier: Apache-2.0
"""Read knobs chosen from what the device does (``kvscope.tune: auto``, ``kvscope tune``).

No single read unit and depth suits every device and chunk size (upstream LMCache PR 5078 shows
it for its own reader), so they are measured on the chunk files themselves, O_DIRECT with the
page cache dropped where allowed:

1. the ceiling: the best rate of a deep raw reader (points of capture/ceiling.py's sweep);
2. service times: one read of each candidate unit alone (depth 1) takes S(u);
3. Little's law: to move X bytes/s when each read takes S(u), X * S(u) bytes must be in flight,
   N(u) = ceil(X * S(u) / u) reads; a reader also verifies what it read (u / hash rate, h(u))
   before its next read, so it keeps a read in flight S / (S + h) of the time: readers =
   ceil(N(u) * (S + h) / S). That is where the search starts, not where it ends: a read alone
   is served faster than the same read among many (the device works on only so many at once,
   the rest queue), so small units need more depth than S(u) alone says (3 MiB chunks on the
   virtio disk: Little's 6 readers read at 0.54x of the ceiling, 32 at 0.75x);
4. each candidate unit is read at that depth, then at twice the depth while the rate still grows
   by more than ``GROWTH`` (up to ``MAX_READERS``): its depth is where the rate stopped growing;
5. the largest unit within ``TOLERANCE`` of the best rate seen (ceiling or candidate) wins
   (fewer, larger reads: fewer wake-ups and less work per byte), its readers and in-flight bytes
   with it; when no candidate comes that close to a ceiling measured in a faster moment, the
   largest unit within ``TOLERANCE`` of the fastest candidate.

Every step is kept as a sentence (``Choice.reasons``) so ``kvscope tune`` can print why. The
reads are O_DIRECT, so the page cache neither helps them nor needs dropping; a server tunes at
start on the chunk files it found (a few seconds), before it serves.
"""

# Standard
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional
import math
import time

# First Party
from kvscope.capture import ceiling
from kvscope.patched_backend.parallel_disk.chunkfile import HEADER_SIZE, hash64

UNITS = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
CEILING_POINTS = ((4 << 20, 32), (16 << 20, 8))
TOLERANCE = 0.03  # the sweep's own repeat-to-repeat noise on a quiet disk
GROWTH = 0.03  # doubling the depth must gain more than this to be worth its threads
MAX_READERS = 64
MIN_BYTES = 256 << 20  # fewer chunk bytes than this on disk: nothing worth measuring
POINT_BYTES = 512 << 20  # bytes read per measurement at depth
ALONE_BYTES = 128 << 20  # bytes read one at a time per unit (service times)


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
    """The raw O_DIRECT reader of capture/ceiling.py (no LMCache, no checks)."""
    return ceiling.read_files(files, unit, depth).bytes_per_s


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


def choose(files: list[Path], chunk_bytes: int, read: Reader,
           verify_bytes_per_s: Optional[float]) -> Choice:
    """Measure with ``read`` on ``files`` (chunk payloads of ``chunk_bytes``, padded) and choose.

    A unit never exceeds a chunk: the engine reads each chunk on its own."""
    mib = 1 << 20
    few = _leading(files, ALONE_BYTES)
    reasons = []
    deep = {(u, d): read(files, u, d) for u, d in CEILING_POINTS}
    best = max(deep.values())
    reasons.append("ceiling: " + ", ".join(f"{u // mib} MiB x {d} {r / 1e9:.2f} GB/s"
                                            for (u, d), r in deep.items())
                   + f"; the best, {best / 1e9:.2f} GB/s, is the target")
    units = sorted({min(u, chunk_bytes) for u in UNITS})
    candidates = []
    for unit in units:
        alone = read(few, unit, 1)
        service = unit / alone
        needed = max(1, math.ceil(best * service / unit))
        verify = unit / verify_bytes_per_s if verify_bytes_per_s else 0.0
        readers = min(MAX_READERS, max(2, math.ceil(needed * (service + verify) / service)))
        reasons.append(
            f"{unit / mib:g} MiB: one read alone takes {service * 1e3:.1f} ms "
            f"({alone / 1e9:.2f} GB/s); {best / 1e9:.2f} GB/s x {service * 1e3:.1f} ms = "
            f"{best * service / mib:.0f} MiB in flight = {needed} reads; verifying one takes "
            f"{verify * 1e3:.1f} ms, so {readers} readers")
        candidates.append((unit, readers))
    measured = []
    for unit, readers in candidates:
        readers, rate = _deepen(files, unit, readers, read, best, reasons)
        measured.append((unit, readers, rate))
    fastest = max(m[2] for m in measured)
    top = max(best, fastest)
    why = f"the largest unit within {TOLERANCE:.0%} of the best rate, {top / 1e9:.2f} GB/s"
    good = [m for m in measured if m[2] >= (1 - TOLERANCE) * top]
    if not good:  # the ceiling was measured in a faster moment than any candidate
        why = (f"none came within {TOLERANCE:.0%} of the ceiling: the largest unit within "
               f"{TOLERANCE:.0%} of the fastest, {fastest / 1e9:.2f} GB/s")
        good = [m for m in measured if m[2] >= (1 - TOLERANCE) * fastest]
    unit, readers, rate = max(good, key=lambda m: (m[0], -m[1]))
    reasons.append(f"chosen: {unit / mib:g} MiB x {readers} readers, "
                   f"{unit * readers / mib:g} MiB in flight, {rate / 1e9:.2f} GB/s ({why})")
    return Choice(unit, readers, unit * readers, best, reasons)


def _deepen(files: list[Path], unit: int, readers: int, read: Reader, best: float,
            reasons: list[str]) -> tuple[int, float]:
    """``unit`` read at ``readers``, then at twice as many while that still gains more than
    GROWTH; the depth where the rate stopped growing and its rate."""
    mib = 1 << 20
    rate = read(files, unit, readers)
    steps = [f"{readers} {rate / 1e9:.2f}"]
    while readers < MAX_READERS:
        deeper = min(MAX_READERS, 2 * readers)
        deeper_rate = read(files, unit, deeper)
        steps.append(f"{deeper} {deeper_rate / 1e9:.2f}")
        if deeper_rate <= (1 + GROWTH) * rate:
            break
        readers, rate = deeper, deeper_rate
    reasons.append(f"{unit / mib:g} MiB by readers (GB/s): {', '.join(steps)}; "
                   f"{readers} readers, {rate / best:.0%} of the ceiling")
    return readers, rate


def chunk_files(directory: Path, limit_bytes: int = POINT_BYTES) -> tuple[list[Path], int]:
    """Chunk files of ``directory`` to measure on (the largest first, about ``limit_bytes``),
    and the largest chunk's padded payload; ([], 0) when there are fewer than MIN_BYTES."""
    files = [f for f in sorted(Path(directory).glob("*.kvc"), key=lambda f: -f.stat().st_size)
             if f.is_file() and not f.is_symlink()]
    sizes = [f.stat().st_size for f in files]
    if sum(sizes) < MIN_BYTES:
        return [], 0
    return _leading(files, limit_bytes), max(sizes) - HEADER_SIZE


def _leading(files: list[Path], limit_bytes: int) -> list[Path]:
    chosen, total = [], 0
    for f in files:
        if total >= limit_bytes:
            break
        chosen.append(f)
        total += f.stat().st_size
    return chosen
