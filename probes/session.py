# SPDX-License-Identifier: Apache-2.0
"""Probe one phase of a run: attach the best probes this host allows, write tables on stop.

    session = probes.session.start(run, "cold", pids={worker_pid})
    ...phase runs...
    session.stop()      # or: with probes.session.start(...): ...

Two modes: "per-io" (default) follows every request from submission to completion and writes one
block_io row per request; "aggregate" (always-on) keeps per-device / per-process histograms and
counters in the kernel from one tracepoint per request and writes rows only for `pids` (thread
or process ids), for long recordings on busy hosts.

BPF failing never breaks the workload: the session says why and falls back to the sysfs
sampler, and manifest["probes"] records which mode ran (docs/probes.md).
"""

from __future__ import annotations

import logging
import platform
import time
from pathlib import Path
from typing import Any, Iterable

from kvscope.contract import rundir
from kvscope.probes.aggregate import AggregateProbe
from kvscope.probes.block import BlockProbe, resolve_device
from kvscope.probes.block_bpf import BlockOptions
from kvscope.probes.btf import BtfError
from kvscope.probes.detect import Fallback, Plan, detect
from kvscope.probes.nvme import NvmeProbe
from kvscope.probes.sampler import InflightSampler, default_devices

log = logging.getLogger("kvscope.probes")
MODES = ("per-io", "aggregate")
AGGREGATE_DEPTH_INTERVAL_S = 1.0  # the kernel's own in-flight counts: a series at ~0.03 % CPU


class ProbeSession:
    """Probes running for one phase of one run; stop() detaches and writes (idempotent)."""

    def __init__(self, run: Path, phase: str, pids: list[int], devices: list[str],
                 mode: str = "per-io") -> None:
        self.run, self.phase, self.pids, self.devices = run, phase, pids, devices
        self.mode = mode
        self.plan: Plan | None = None
        self.fallback: Fallback | None = None
        self.block: BlockProbe | None = None
        self.aggregate: AggregateProbe | None = None
        self.nvme: NvmeProbe | None = None
        self.sampler: InflightSampler | None = None
        self.nvme_error = ""
        self.started_ns = 0
        self._stopped = False

    def _start(self) -> None:
        found = detect()
        if isinstance(found, Plan):
            try:
                self._start_bpf(found)
            except Exception as e:  # compile or attach failure: never break the workload
                log.debug("BPF start failed", exc_info=True)
                found = Fallback(f"the BPF program failed to compile or attach ({e})",
                                 "see docs/probes.md, 'When BPF fails'; rerun scripts/setup.sh")
        if isinstance(found, Fallback):
            self.fallback = found
            log.warning("%s", found.message())
            self.sampler = InflightSampler(self.devices or default_devices())
        self.started_ns = time.monotonic_ns()

    def _start_bpf(self, plan: Plan) -> None:
        if self.mode == "aggregate":
            self._start_aggregate(plan)
            return
        opts = BlockOptions(key=plan.key, attach=plan.attach,
                            start_tracepoint=plan.start_tracepoint, offsets=plan.offsets,
                            flush_seq_bit=plan.flush_seq_bit)
        if plan.note:
            log.warning("kvscope probes: %s", plan.note)
        self.block = BlockProbe(opts, pids=self.pids, devices=self.devices)
        try:
            self.block.start()
        except BaseException:
            self.block = None
            raise
        self.plan = plan
        if plan.nvme:
            self._start_nvme()

    def _start_aggregate(self, plan: Plan) -> None:
        """Needs raw tracepoints and BTF (the `rq` plan) for the kernel's request timestamps."""
        if plan.key != "rq":
            raise RuntimeError(f"aggregate mode reads struct request through BTF at raw "
                               f"tracepoints, which this kernel lacks: {plan.note}")
        try:
            probe = AggregateProbe(track=self.pids, devices=self.devices)
        except BtfError as e:
            raise RuntimeError(f"aggregate mode: {e}") from e
        probe.start()
        try:
            self.sampler = InflightSampler(self.devices or default_devices(),
                                           interval_s=AGGREGATE_DEPTH_INTERVAL_S)
        except BaseException:
            probe.stop()
            raise
        self.aggregate = probe
        self.plan = plan

    def _start_nvme(self) -> None:
        """NVMe failing to attach costs only the NVMe rows; block probing carries on."""
        try:
            self.nvme = NvmeProbe().start()
        except Exception as e:
            log.debug("NVMe probe start failed", exc_info=True)
            log.warning("kvscope probes: the NVMe probe failed to compile or attach (%s); "
                        "block requests are still recorded, nvme_io is not", e)
            self.nvme_error = str(e)

    def stop(self) -> None:
        """Detach everything, append this phase's rows and update manifest["probes"]."""
        if self._stopped:
            return
        self._stopped = True
        ended_ns = time.monotonic_ns()
        for probe in (self.block, self.nvme, self.aggregate):
            if probe is not None:
                probe.stop()
        record: dict[str, Any] = {"started_ns": self.started_ns, "ended_ns": ended_ns}
        if self.aggregate is not None and self.sampler is not None and self.plan is not None:
            record.update(self._write_aggregate(self.aggregate, self.sampler, self.plan))
        elif self.sampler is not None and self.fallback is not None:
            record.update(self._write_sampler(self.sampler, self.fallback))
        elif self.block is not None and self.plan is not None:
            record.update(self._write_bpf(self.block, self.plan))
        else:
            raise RuntimeError("the probe session stopped without having started")
        record["probe_mode"] = self.mode
        _record_phase(self.run, self.phase, record, self.pids, self.devices)

    def _write_sampler(self, sampler: InflightSampler, fallback: Fallback) -> dict[str, Any]:
        depth, diskstats = sampler.stop(self.phase)
        rundir.append_table(self.run, "queue_depth", depth)
        record: dict[str, Any] = {"mode": "fallback-sampler", "tracepoints": [],
                                  "why_fallback": fallback.message(), "lost_events": {},
                                  "rows": {"queue_depth": len(depth)}, "diskstats": diskstats}
        if self.pids:
            record["pid_filter"] = "not applied: the sampler sees whole devices"
        return record

    def _write_aggregate(self, aggregate: AggregateProbe, sampler: InflightSampler, plan: Plan
                         ) -> dict[str, Any]:
        result = aggregate.result(self.phase)
        depth, diskstats = sampler.stop(self.phase)
        tables = {"io_histograms": result.histograms, "io_totals": result.totals,
                  "queue_depth": depth}
        if self.pids:  # no tracked ids: no block_io table rather than an empty one
            tables["block_io"] = result.block_io
        for name, frame in tables.items():
            rundir.append_table(self.run, name, frame)
        return {"mode": "bpf", "key": plan.key, "key_note": plan.note,
                "tracepoints": aggregate.tracepoints, "why_fallback": "",
                "lost_events": result.lost_events,
                "rows": {name: len(frame) for name, frame in tables.items()},
                "tracked_ids": self.pids, "diskstats": diskstats}

    def _write_bpf(self, block: BlockProbe, plan: Plan) -> dict[str, Any]:
        result = block.result(self.phase)
        rundir.append_table(self.run, "block_io", result.block_io)
        rundir.append_table(self.run, "queue_depth", result.queue_depth)
        rows = {"block_io": len(result.block_io), "queue_depth": len(result.queue_depth)}
        lost = dict(result.lost_events)
        record: dict[str, Any] = {"histograms_log2_us": result.histograms,
                                  "lost_by_op": result.lost_by_op}
        if self.nvme_error:
            record["nvme_error"] = self.nvme_error
        if self.nvme is not None:
            nvme = self.nvme.result(self.phase)
            rundir.append_table(self.run, "nvme_io", nvme.nvme_io)
            rundir.append_table(self.run, "queue_depth", nvme.queue_depth)
            rows.update(nvme_io=len(nvme.nvme_io),
                        queue_depth=rows["queue_depth"] + len(nvme.queue_depth))
            lost.update(nvme.lost_events)
            record["nvme"] = nvme.summary
        return {"mode": "bpf", "key": plan.key, "key_note": plan.note,
                "tracepoints": plan.tracepoints,
                "why_fallback": "", "lost_events": lost, "rows": rows, **record}

    def __enter__(self) -> "ProbeSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _record_phase(run: Path, phase: str, record: dict[str, Any], pids: list[int],
                  devices: list[str]) -> None:
    """manifest["probes"]: the latest phase's mode at the top, every phase under `phases`."""
    section = rundir.read_manifest(run).get("probes") or {"phases": {}}
    section["phases"][phase] = record
    section.update(
        mode=record["mode"], probe_mode=record["probe_mode"], tracepoints=record["tracepoints"],
        why_fallback=record["why_fallback"], pids=pids, devices=devices,
        lost_events=sum(max(n, 0) for p in section["phases"].values()
                        for n in p["lost_events"].values()),
        kernel=platform.release(),
    )
    rundir.update_manifest(run, "probes", section)


def start(run: Path, phase: str, *, pids: Iterable[int] | None = None,
          devices: Iterable[str] | None = None, mode: str = "per-io") -> ProbeSession:
    """Attach probes for `phase` of the run at `run` (which must exist); returns quickly (~1 s).

    mode "per-io": `pids` (tgids) filter the rows and histograms. mode "aggregate": every
    request on `devices` is counted in kernel histograms; `pids` (thread or process ids) are
    the ones whose requests also become block_io rows and per-process histograms.
    """
    if mode not in MODES:
        raise ValueError(f"probe mode {mode!r}: expected one of {', '.join(MODES)}")
    run = Path(run)
    rundir.read_manifest(run)  # fail now, not after the phase, if RUN is not a run directory
    for device in devices or ():
        resolve_device(device)  # a clear ValueError for a bad name, before any BPF work
    for pid in pids or ():
        if not Path(f"/proc/{pid}").exists():
            raise ValueError(f"pid {pid}: no such process; pass the pid of a running process "
                             f"(for vLLM, the worker process that reads the KV chunks)")
    session = ProbeSession(run, phase, sorted(set(pids or ())), sorted(set(devices or ())), mode)
    session._start()
    return session
