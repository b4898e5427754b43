# SPDX-License-Identifier: Apache-2.0
"""The life of every BPF probe: compile, fill maps, attach, record, detach, drain, report.

`Probe` holds the order that makes a probe exact at its edges and safe to stop twice: maps are
filled before any program is attached; on stop every program is detached (kept loaded, so its
maps and run counts stay readable) before the ring buffers and maps are drained, so nothing
lands after the final drain; then everything is closed. A probe says only what differs: its
program text, what it attaches by hand, its ring buffers, and how it turns what it drained
into a result.
"""

from __future__ import annotations

import json
import subprocess
import time
from abc import ABC, abstractmethod
from typing import Any, Generic, Self, TypeVar

import numpy as np

from kvscope.probes import tp_btf
from kvscope.probes.collect import RingCollector

ResultT = TypeVar("ResultT")


class Probe(ABC, Generic[ResultT]):
    """start() attaches and stop() detaches and drains, both idempotent; result(phase) after.

    Needs root and bcc.
    """

    ring_poll_ms = 50  # how often the ring buffers are drained while recording

    def __init__(self) -> None:
        self._bpf: Any = None
        self._attached: list[tp_btf.Attached] = []
        self._collector: RingCollector | None = None
        self._stopped = False
        self.started_ns = self.stopped_ns = 0

    @abstractmethod
    def program_text(self) -> str:
        """The C text bcc compiles (classic TRACEPOINT_PROBEs in it attach as it loads)."""

    def _prepare(self, bpf: Any) -> None:
        """Fill the maps the programs read (filters, device indexes) before they run."""

    def _attach(self, bpf: Any) -> list[tp_btf.Attached]:
        """Attach the programs bcc does not attach by itself (tp_btf, raw tracepoints)."""
        return []

    def _rings(self) -> dict[str, np.dtype]:
        """Ring buffers to drain while recording, by map name, with their record layout."""
        return {}

    @abstractmethod
    def _drain(self, bpf: Any, records: dict[str, np.ndarray], bad_sizes: dict[str, int]) -> None:
        """Keep what result() needs from the detached programs' maps and the drained records."""

    @abstractmethod
    def _result(self, phase: str) -> ResultT:
        """The tables and counters of the stopped probe."""

    def start(self) -> Self:
        if self._bpf is not None:
            return self
        from bcc import BPF

        bpf = BPF(text=self.program_text().encode())
        try:
            self._prepare(bpf)
            rings = self._rings()
            if rings:
                self._collector = RingCollector(bpf, rings, poll_ms=self.ring_poll_ms)
            self._attached = self._attach(bpf)
        except BaseException:
            self._close(bpf)
            raise
        self._bpf = bpf
        self.started_ns = time.monotonic_ns()
        return self

    def stop(self) -> None:
        """Detach every program, then drain what they recorded (kept for result())."""
        if self._bpf is None:
            return
        bpf, self._bpf = self._bpf, None
        try:
            for program in self._attached:
                program.detach()
            for tracepoint in list(bpf.tracepoint_fds):
                bpf.detach_tracepoint(tracepoint)
            self.stopped_ns = time.monotonic_ns()
            records: dict[str, np.ndarray] = {}
            bad_sizes: dict[str, int] = {}
            if self._collector is not None:
                records, bad_sizes = self._collector.stop(), self._collector.bad_sizes
                self._collector = None
            self._drain(bpf, records, bad_sizes)
            self._stopped = True
        finally:
            self._close(bpf)

    def _close(self, bpf: Any) -> None:
        if self._collector is not None:  # not drained: start() failed
            self._collector.stop()
            self._collector = None
        for program in self._attached:
            program.close()
        self._attached = []
        bpf.cleanup()

    def result(self, phase: str) -> ResultT:
        """Tables and counters of the stopped probe."""
        if not self._stopped:
            raise RuntimeError(f"{type(self).__name__}.result() needs a started and stopped "
                               f"probe")
        return self._result(phase)

    def program_ids(self) -> list[int]:
        """Kernel ids of the loaded programs (`bpftool prog show id N`), to check detaching."""
        return sorted(self._ids_by_name().values())

    def _ids_by_name(self) -> dict[str, int]:
        """Program name -> kernel id, of bcc's own programs and those attached by hand."""
        ids = {p.name: p.prog_id() for p in self._attached}
        if self._bpf is not None:
            for name, fn in self._bpf.funcs.items():
                if name.decode() not in ids:
                    ids[name.decode()] = tp_btf.prog_id(fn.fd)
        return ids

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def bpftool_misses() -> dict[int, int] | None:
    """recursion_misses of every loaded program by id (`bpftool prog show`); None without
    bpftool."""
    try:
        out = subprocess.run(["bpftool", "prog", "show", "-j"], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {p["id"]: p.get("recursion_misses", 0) for p in json.loads(out)}


def recursion_misses(ids: dict[str, int], twins: tuple[str, ...] = ()) -> dict[str, int]:
    """Runs the kernel skipped because the program was already running on that CPU, from
    `bpftool prog show` (-1 without bpftool). Skips of the `twins` (the completion programs
    that stand in for each other) are `complete_nested`: the other one took those unless both
    were busy, which the probe counts itself."""
    misses = bpftool_misses()
    if misses is None:
        return {"recursion_misses": -1}
    counts = {"recursion_misses": sum(misses.get(i, 0) for n, i in ids.items()
                                      if n not in twins)}
    if twins:
        counts["complete_nested"] = sum(misses.get(ids[n], 0) for n in twins if n in ids)
    return counts

