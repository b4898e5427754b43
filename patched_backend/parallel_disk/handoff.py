# SPDX-License-Identifier: Apache-2.0
"""Chunks handed to the KV transfer before their reads end (knob ``pipeline_transfer``).

Why: LMCache's retrieve reads all of a request's chunks (``batched_get_blocking``) and only
then copies them into the KV cache (the connector's ``batched_to_gpu``), so the copy of the
first chunk waits for the last read and a request's load ends one whole copy after its last
byte arrived. Inside a pipelined get (``pipelined_get``: a retrieve whose only copy of the got
chunks is the one ``pipelined_connector.py`` makes, chunk by chunk), the get hands its memory
objects out at once and each chunk is copied as soon as its own reads are verified, while the
later ones are still being read.

What stays true:

* only a get inside a pipelined get, on that thread, hands anything out; every other get (a
  retrieve of an engine that copies chunks itself, such as LMCache's MLA broadcast, a move, a
  compression, a peer's or a layerwise get) verifies every chunk before it returns;

* a chunk is copied only once every byte of it is verified; one that fails after it was handed
  out (checksum, I/O error, timeout) is not copied, nor is any chunk after it (LMCache serves a
  prefix), and the consumer reports their tokens to vLLM as a load error so they are
  recomputed, as for a short retrieve;
* the memory of a handed-out chunk holds one more reference until its read ends, so LMCache
  freeing it after the copy never lets a reader write into reused memory;
* pins, refusals, LRU and counters are settled in the consumer's thread once it is done with
  the chunks (``finish``), as the blocking get settles them, and read-ahead claims are reported
  there too (inside the request's load, where the tracer looks for them).
"""

import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from kvscope.patched_backend.parallel_disk.reads import ReadPath, Slot, release_when_done

logger = logging.getLogger(__name__)
Error = tuple[str, str]
# Reports the tokens [start, end) of a retrieve as not loaded; returns False when it cannot.
LoadErrorSink = Callable[[dict[str, Any], int, int], bool]

_lock = threading.Lock()
_handed: dict[int, tuple["Handoff", Slot]] = {}  # id(memory object) -> its handoff
_local = threading.local()  # .scope: the pipelined get this thread is in, if any


class _Scope:
    def __init__(self, ready: Callable[[], bool]) -> None:
        self.ready = ready
        self.handoffs: list[Handoff] = []


@contextmanager
def pipelined_get(ready: Callable[[], bool]) -> Iterator[None]:
    """Gets on this thread, inside the block, may hand chunks out.

    The caller promises that the chunks are copied only by a consumer that waits for each one
    (``take`` and ``Handoff.wait``); ``ready()`` says whether a late failure can be reported
    right now (until then gets block as before). On the way out every handoff of the block is
    settled, taken or not, so an engine that raised before its copy leaks no pin or reference.
    """
    scope = _Scope(ready)
    outer, _local.scope = getattr(_local, "scope", None), scope
    try:
        yield
    except BaseException:
        _settle_untaken(scope)
        raise
    finally:
        _local.scope = outer
    if _settle_untaken(scope):
        logger.error("kvscope: chunks handed out in a pipelined get were never taken by its "
                     "connector; LMCache copied them some other way")


def _settle_untaken(scope: _Scope) -> int:
    """Settle the handoffs no consumer finished; how many there were."""
    untaken = [h for h in scope.handoffs if not h.finished]
    for h in untaken:
        h.finish()
    return len(untaken)


def hands_out_here() -> bool:
    """Whether a get on this thread may hand its chunks out (inside a ready pipelined get)."""
    scope: Optional[_Scope] = getattr(_local, "scope", None)
    return scope is not None and scope.ready()


class Handoff:
    """The chunks one get handed out: waited for one by one, then settled together."""

    def __init__(self, reads: ReadPath, slots: list[Optional[Slot]], handed: int,
                 deadline: float, timeout_s: float,
                 on_finish: Callable[[], None]) -> None:
        self._reads, self._slots, self._handed = reads, slots, handed
        self._deadline, self._timeout_s, self._on_finish = deadline, timeout_s, on_finish
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    def wait(self, slot: Slot) -> Optional[Error]:
        """Block until ``slot``'s chunk is read and verified (or the get's deadline); its error."""
        if not slot.chunk.wait(max(0.0, self._deadline - time.monotonic())):
            slot.chunk.fail("timeout", f"{slot.entry.path} not read within {self._timeout_s:g} s")
        return slot.chunk.error

    def finish(self) -> None:
        """The consumer is done: settle every slot once (later calls do nothing)."""
        if self._finished:
            return
        self._finished = True
        with _lock:
            for slot in self._slots[: self._handed]:
                if slot is not None:
                    _handed.pop(id(slot.obj), None)
        for slot in self._slots[: self._handed]:
            if slot is not None and not slot.chunk.done:
                self.wait(slot)  # only after a failure: the consumer stopped before it
        self._on_finish()
        self._reads.settle_slots(self._slots, handed=self._handed)


def hand_out(reads: ReadPath, slots: list[Optional[Slot]], deadline: float, timeout_s: float,
             on_finish: Callable[[], None]) -> list[Optional[Any]]:
    """The memory objects of ``slots``' leading chunks not known to have failed, registered for
    the consumer; the rest are None (a miss, as LMCache expects: a prefix)."""
    handed = 0
    for slot in slots:
        if slot is None or (slot.chunk.done and slot.chunk.error is not None):
            break
        handed += 1
    handoff = Handoff(reads, slots, handed, deadline, timeout_s, on_finish)
    scope: Optional[_Scope] = getattr(_local, "scope", None)
    if scope is not None:
        scope.handoffs.append(handoff)
    results: list[Optional[Any]] = [None] * len(slots)
    with _lock:
        for i, slot in enumerate(slots[:handed]):
            assert slot is not None
            slot.obj.ref_count_up()  # dropped when the read ends: LMCache frees after the copy
            release_when_done(slot)
            reads.restore_metadata(slot)
            _handed[id(slot.obj)] = (handoff, slot)
            results[i] = slot.obj
    if handed == 0:
        handoff.finish()
    return results


def take(obj: Any) -> Optional[tuple[Handoff, Slot]]:
    """The handoff and slot of a handed-out memory object, or None (an object read before)."""
    with _lock:
        return _handed.get(id(obj))
