# SPDX-License-Identifier: Apache-2.0
"""Chunks handed to the KV transfer before their reads end (knob ``pipeline_transfer``).

Why: LMCache's retrieve reads all of a request's chunks (``batched_get_blocking``) and only
then copies them into the KV cache (the connector's ``batched_to_gpu``), so the copy of the
first chunk waits for the last read and a request's load ends one whole copy after its last
byte arrived. When a consumer that waits chunk by chunk is installed in the process
(``pipelined_connector.py``, wrapping the CPU connector or LMCache's CUDA one), the get hands
its memory objects out at once and each chunk is copied as soon as its own reads are verified,
while the later ones are still being read.

What stays true:

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

# Standard
from typing import Any, Callable, Optional
import threading
import time

# First Party
from kvscope.patched_backend.parallel_disk.reads import ReadPath, Slot, release_when_done

Error = tuple[str, str]
# Reports the tokens [start, end) of a retrieve as not loaded; returns False when it cannot.
LoadErrorSink = Callable[[dict[str, Any], int, int], bool]

_lock = threading.Lock()
_handed: dict[int, tuple["Handoff", Slot]] = {}  # id(memory object) -> its handoff
_consumer: list[Callable[[], bool]] = []  # says whether the installed consumer can report


def install_consumer(ready: Callable[[], bool]) -> None:
    """A consumer that waits per chunk exists in this process; ``ready()`` says whether it can
    report a late failure right now (until then every get blocks as before)."""
    with _lock:
        _consumer[:] = [ready]


def uninstall_consumer() -> None:
    """No consumer any more: gets block until their chunks are read (tests)."""
    with _lock:
        _consumer.clear()


def consumer_ready() -> bool:
    """True when handed-out chunks would be waited for, and a late failure reported."""
    with _lock:
        ready = _consumer[0] if _consumer else None
    return ready is not None and ready()


class Handoff:
    """The chunks one get handed out: waited for one by one, then settled together."""

    def __init__(self, reads: ReadPath, slots: list[Optional[Slot]], handed: int,
                 deadline: float, timeout_s: float,
                 on_finish: Callable[[], None]) -> None:
        self._reads, self._slots, self._handed = reads, slots, handed
        self._deadline, self._timeout_s, self._on_finish = deadline, timeout_s, on_finish
        self._finished = False

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
