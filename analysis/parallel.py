"""Independent pieces of one analysis (span files, slices of requests) on every core.

Converting and attributing a long run is pure-Python-heavy work on pieces that do not depend
on each other, so the GIL keeps one process to one core; worker processes, one per core, do
the pieces while the caller consumes the results in order. Workers are spawned (a fork of a
process that holds threads, pyarrow's or a server's, can deadlock), which costs a second or
two of imports each, so callers use them only for work that repays that. A daemonic process
(a Dask worker, a multiprocessing pool's worker) may not start processes: it works alone.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
AHEAD = 2  # pieces a worker may hold done or queued beyond the one the caller is waiting for


def cores() -> int:
    """Worker processes this process may use: its CPUs, 1 when it may not start any."""
    if multiprocessing.current_process().daemon:
        return 1
    return len(os.sched_getaffinity(0))


def ordered(work: Callable[..., T], pieces: Iterable[tuple[Any, ...]], workers: int
            ) -> Iterator[T]:
    """`work(*piece)` of each piece, in the pieces' order: here when `workers` < 2, else in
    that many spawned processes with at most AHEAD pieces a worker in flight (so memory holds
    a bounded number of pieces' inputs and results, whatever the caller's pace)."""
    if workers < 2:
        yield from (work(*piece) for piece in pieces)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        pending: deque[Future[T]] = deque()
        for piece in pieces:
            pending.append(pool.submit(work, *piece))
            if len(pending) > AHEAD * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
