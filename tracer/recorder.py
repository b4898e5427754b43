# SPDX-License-Identifier: Apache-2.0
"""This process's span records: one ring per serving thread, handed to the exporter process.

A serving thread's span costs a span id, one `marshal.dumps` of the caller's values and one
write into its own ring (tracer/span_ring.py): no SDK Span, no lock, no export work. A ring is
made the first time a thread records, and `on_ring` (tracer/exporter_link.py) passes it to the
exporter process. The process's kvscope error counts (tracer/failsafe.py) ride in the rings
too, as an ERRORS mark written by the first span after they change.
"""

from __future__ import annotations

import marshal
import os
import threading
from typing import Any, Callable, Mapping

from kvscope.contract import span_record as rec
from kvscope.tracer import failsafe
from kvscope.tracer.span_ring import Ring

RING_BYTES = 4 << 20  # per serving thread: seconds of spans while an exporter restarts
MAX_RINGS = 256  # threads beyond this record nothing (counted as recorder.rings errors)
_SCALARS = (str, bool, int, float)


class Recorder:
    def __init__(self, on_ring: Callable[[Ring], None], ring_bytes: int = RING_BYTES) -> None:
        self.on_ring = on_ring
        self.ring_bytes = ring_bytes
        self.rings: list[Ring] = []
        self._local = threading.local()
        self._lock = threading.Lock()  # taken once per thread, to make its ring
        self._errors_seen = -1

    def put(self, name: str, kind: int, flags: int, trace_id: int, span_id: int, parent: int,
            start_ns: int, end_ns: int, values: tuple[Any, ...]) -> None:
        """Record one span or mark; `values`: (request id, vLLM request id, attributes, extra:
        a mapping of the rare fields, or None)."""
        try:
            ring = self._local.ring
        except AttributeError:
            ring = self._new_ring()
        if ring is None:
            return
        if failsafe.version() != self._errors_seen:
            self._put_errors(ring)
        index = rec.NAME_INDEX.get(name)
        if index is None:
            index = rec.NAME_IN_VALUES
            values = (*values[:3], {**(values[3] or {}), "name": name})
        try:
            encoded = marshal.dumps(values)
        except ValueError:  # a value marshal cannot carry (numpy, objects): left out, as OTLP does
            encoded = marshal.dumps(_carried(values))
        ring.put(index, kind, flags, trace_id, span_id, parent, start_ns, end_ns, encoded)

    def flush_errors(self) -> None:
        """Send the error counts on if they changed since the last span (at exit)."""
        ring = getattr(self._local, "ring", None) or next(iter(self.rings), None)
        if ring is not None and failsafe.version() != self._errors_seen:
            self._put_errors(ring)

    def _put_errors(self, ring: Ring) -> None:
        self._errors_seen = failsafe.version()
        ring.put(0, rec.MARK_ERRORS, 0, 0, 0, 0, 0, 0,
                 marshal.dumps((None, None, failsafe.counts(), None)))

    def _new_ring(self) -> Ring | None:
        ring: Ring | None = None
        with self._lock:
            try:
                if len(self.rings) >= MAX_RINGS:
                    raise RuntimeError(f"more than {MAX_RINGS} threads record spans")
                ring = Ring.create(self.ring_bytes)
                self.rings.append(ring)
            except Exception as e:
                failsafe.count("recorder.ring", e, fix="spans of this thread are not recorded")
        self._local.ring = ring
        if ring is not None:
            self.on_ring(ring)
        return ring

    def close_inherited(self) -> None:
        """In a forked child: its parent's rings are its parent's to write (fds closed here)."""
        for ring in self.rings:
            try:
                os.close(ring.fd)
            except OSError:
                pass
        self.rings = []
        self._local = threading.local()


def _carried(values: tuple[Any, ...]) -> tuple[Any, ...]:
    request_id, vllm_request_id, attributes, extra = values
    kept = {k: v for k, v in (attributes or {}).items() if _is_value(v)}
    return (request_id, vllm_request_id, kept, extra)


def _is_value(value: Any) -> bool:
    """An attribute value OTLP carries: a scalar, or a list or tuple of scalars."""
    if isinstance(value, _SCALARS):
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, _SCALARS) for v in value)


def carried_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """The attributes OTLP can carry (the exporter's side of the same rule)."""
    return {k: v for k, v in attributes.items() if _is_value(v)}
