# SPDX-License-Identifier: Apache-2.0
"""The exporter process: one per traced server, started by tracer/exporter_link.py.

    python -m kvscope.tracer.exporter NAME STARTER_PID

It takes every ring the server's processes hand it, reads them every POLL_S, turns each record
back into the span the OpenTelemetry SDK would have made (the same ids, times, attributes,
events, status, and a resource per serving process) and feeds it to that process's pipeline
(tracer/pipeline.py: the OTLP/JSON files, OTLP, the per-exporter counts and the process's
stats file), through tail sampling when OTEL_TRACES_SAMPLER asks for it. Records a ring had to
drop (this process was too slow or being restarted) are counted dropped by every exporter.

The stats are written before the rings are told what was taken, so an exporter killed between
the two leaves its successor (started by the supervisor at the same address) to read those
records again rather than lose them uncounted; its successor counts what the dead one had
pending as lost. It exits once the process that started it and every process that connected
are gone, after their rings are drained and their spans exported or counted lost.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

from opentelemetry import trace
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from kvscope.contract import jsonfiles, semconv
from kvscope.contract import span_record as rec
from kvscope.tracer import config, exporter_link, failsafe, metrics, pipeline
from kvscope.tracer.recorder import carried_attributes
from kvscope.tracer.span_ring import Ring, RingError
from kvscope.tracer.tail_sampling import TailSampler
from kvscope.tracer.version import SCOPE as SCOPE_NAME, __version__

logger = logging.getLogger("kvscope.tracer.exporter")

SCOPE = InstrumentationScope(SCOPE_NAME, __version__)
# A round as often as the files are written: more rounds would cost CPU and save no latency
POLL_S = pipeline.FILE_FLUSH_MS / 1000
HELLO_TIMEOUT_S = 5.0
READ_LIMIT = 8192  # records per ring per round
DRAIN_S = 5.0  # a closed process's records wait this long for room in a full exporter queue
MAX_RINGS = 4096  # per exporter: more descriptors than this are refused
EXPORTER_STATS = "exporter"  # RUN/spans/stats/exporter-<pid>.json: its errors, sampling counts
_KINDS = {rec.INTERNAL: trace.SpanKind.INTERNAL, rec.SERVER: trace.SpanKind.SERVER,
          rec.CLIENT: trace.SpanKind.CLIENT}
_SAMPLED = trace.TraceFlags(trace.TraceFlags.SAMPLED)


def readable_span(record: rec.SpanRecord, resource: Any, offset_ns: int) -> ReadableSpan:
    """The span `record` stands for, as the SDK would have ended it."""
    extra = record.extra
    state = trace.TraceState.from_header([extra["trace_state"]]) \
        if extra.get("trace_state") else None
    context = trace.SpanContext(record.trace_id, record.span_id, False, _SAMPLED, state)
    parent = trace.SpanContext(record.trace_id, record.parent_span_id,
                               bool(record.flags & rec.PARENT_REMOTE), _SAMPLED, state) \
        if record.parent_span_id else None
    attributes = carried_attributes(record.attributes)
    if record.request_id is not None:
        attributes = {semconv.REQUEST_ID: record.request_id,
                      semconv.VLLM_REQUEST_ID: record.vllm_request_id, **attributes}
    status = trace.Status(trace.StatusCode.ERROR, extra.get("status")) \
        if record.flags & rec.ERROR else trace.Status(trace.StatusCode.UNSET)
    return ReadableSpan(
        name=record.name, context=context, parent=parent, resource=resource,
        attributes=attributes, kind=_KINDS.get(record.kind, trace.SpanKind.INTERNAL),
        events=[Event(name, timestamp=at + offset_ns) for name, at in extra.get("events", ())],
        status=status, instrumentation_scope=SCOPE, start_time=record.start_ns + offset_ns,
        end_time=record.end_ns + offset_ns)


class Source:
    """One serving process: its rings, its pipeline and what it told us about its errors."""

    def __init__(self, hello: dict[str, Any], conn: socket.socket) -> None:
        self.pid = int(hello["pid"])
        self.offset_ns = int(hello["offset_ns"])
        self.conn: socket.socket | None = conn
        self.rings: list[Ring] = []
        self.ring_drops_before = 0  # counted by a predecessor into the counts carried over
        self.errors: dict[str, int] = {}
        self.pipeline = pipeline.build(str(hello["service"]), str(hello["prefix"]),
                                       pid=self.pid)
        self.pipeline.errors = lambda: self.errors
        self.pipeline.amend = self.amend
        self.resource = self.pipeline.provider.resource
        self._carry_over()

    def _carry_over(self) -> None:
        """Go on from a dead predecessor's counts for this process: what it had pending is
        lost, and the error counts stand until the process sends new ones."""
        stats = self.pipeline.stats_file
        if stats is None or not stats.path.is_file():
            return
        found, _ = jsonfiles.read_json_files([stats.path], pipeline.STATS_MAX_BYTES,
                                             pipeline.STATS_SCHEMA)
        if not found:
            return
        before, counters = found[0], self.pipeline.counters
        self.ring_drops_before = int(before.get("records", {}).get("dropped_ring_full", 0))
        counters.spans_ended = int(before.get("spans_ended", 0)) - self.ring_drops_before
        for name, counts in before.get("by_exporter", {}).items():
            mine = counters.of(name)
            for key in ("accepted", "exported", "failed", "export_failures"):
                setattr(mine, key, int(counts.get(key, 0)))
            mine.dropped = int(counts.get("dropped", 0)) - self.ring_drops_before
            mine.lost = int(counts.get("lost", 0)) + int(counts.get("pending", 0))
        self.errors = {**before.get("hook_errors", {}),
                       **{failsafe.CONFIG + key: n
                          for key, n in before.get("config_errors", {}).items()}}

    def room(self) -> int:
        """Spans the roomiest exporter queue still takes: a slow collector's queue overflows
        (counted dropped, as in the serving process before) without holding up the files."""
        processors = self.pipeline.processors.values()
        return max((p.limit - p.exporter.counts.pending for p in processors), default=READ_LIMIT)

    def amend(self, stats: dict[str, Any]) -> dict[str, Any]:
        """`stats` with the rings' counts: records a ring could not hold are ended spans that
        every exporter dropped (the ring counts since it was made, so a successor subtracts
        what its predecessor had added, `_carry_over`)."""
        written = dropped = taken = 0
        for ring in self.rings:
            w, d, t = ring.counts()
            written, dropped, taken = written + w, dropped + d, taken + t
        new = dropped - self.ring_drops_before
        stats["spans_ended"] += new
        stats["spans_dropped"] += new * len(stats["by_exporter"])
        for counts in stats["by_exporter"].values():
            counts["dropped"] += new
        stats["records"] = {"written": written, "dropped_ring_full": dropped, "taken": taken}
        return stats


Item = tuple[Source, rec.SpanRecord]


class Exporter:
    def __init__(self, listener: socket.socket, starter_pid: int,
                 sampler: TailSampler[Item] | None = None) -> None:
        self.listener = listener
        self.starter_pid = starter_pid
        self.identity = config.identity()
        spans_dir = config.load().spans_dir
        self.stats = None if spans_dir is None else \
            pipeline.StatsFile(spans_dir, EXPORTER_STATS, os.getpid())
        self.stages = metrics.stage_metrics(lambda: [])  # /metrics: every process's spans
        self._written: tuple[Any, ...] = ()
        self.sources: dict[socket.socket, Source] = {}
        self.done: list[Source] = []
        self.sampler = sampler
        self.starter_gone = False
        self.stopping = False
        try:
            self.starter = os.pidfd_open(starter_pid)
        except OSError:  # already gone
            self.starter, self.starter_gone = -1, True
        self._refused_logged = False

    def run(self) -> None:
        while not (self.stopping or (self.starter_gone and not self.sources)):
            waiting = [self.listener, *self.sources] + ([self.starter] if self.starter >= 0
                                                        and not self.starter_gone else [])
            readable, _, _ = select.select(waiting, [], [], POLL_S)
            for ready in readable:
                if ready is self.listener:
                    self._accept()
                elif isinstance(ready, socket.socket):
                    self._message(ready)
                else:
                    self.starter_gone = True
            self.poll()
        self.finish()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        uid = exporter_link.peer_uid(conn)
        if uid != os.getuid():
            logger.warning("kvscope exporter: refused a connection from uid %d (only uid %d's "
                           "processes hand spans here)", uid, os.getuid())
            conn.close()
            return
        try:
            conn.settimeout(HELLO_TIMEOUT_S)  # a process that connects and says nothing
            data = conn.recv(exporter_link.MAX_MESSAGE)
            conn.settimeout(None)
            hello = json.loads(data)["hello"]
            if hello.get("config") != self.identity:  # it inherited another server's address
                conn.sendall(b'{"refused": "another configuration"}')
                conn.close()
                return
            self.sources[conn] = Source(hello, conn)
            conn.sendall(exporter_link.ACCEPTED)
        except Exception as e:
            logger.warning("kvscope exporter: a process's greeting was refused: %s", e)
            conn.close()

    def _message(self, conn: socket.socket) -> None:
        source = self.sources[conn]
        try:
            data, fds, _, _ = socket.recv_fds(conn, exporter_link.MAX_MESSAGE, 4)
        except OSError:
            data, fds = b"", []
        for fd in fds:
            self._attach(source, fd)
        if not data or data == b'{"bye": true}':
            self._close(source)

    def _attach(self, source: Source, fd: int) -> None:
        try:
            if sum(len(s.rings) for s in self.sources.values()) >= MAX_RINGS:
                raise RingError(f"more than {MAX_RINGS} rings")
            ring = Ring.attach(fd)
        except (OSError, RingError) as e:
            os.close(fd)
            logger.warning("kvscope exporter: a ring from pid %d was refused: %s", source.pid, e)
            return
        source.rings.append(ring)

    def _close(self, source: Source) -> None:
        """The process said goodbye or went away: its rings are read to the end."""
        assert source.conn is not None
        del self.sources[source.conn]
        source.conn.close()
        source.conn = None
        if source.pid == self.starter_pid:  # it waits for us now: nobody restarts us any more
            self.starter_gone = True
        self._read(source, drain=True)
        self.done.append(source)

    def poll(self) -> None:
        for source in list(self.sources.values()):
            self._read(source, drain=False)
        if self.sampler is not None:
            self._export(self.sampler.end_round(time.monotonic()))
        self._write_own_stats(closed=False)

    def _write_own_stats(self, closed: bool) -> None:
        """This process's own errors (a part it could not write, say; not the configuration's,
        which every serving process counts already) and the tail sampler's counts, in a stats
        file of its own, summed with every serving process's into manifest.tracer, whenever
        they change; no file while there is nothing to say."""
        sampling = {} if self.sampler is None else {"sampling": self.sampler.counts()}
        errors = {where: n for where, n in failsafe.counts().items()
                  if not where.startswith(failsafe.CONFIG)}
        state = (sampling, errors, closed)
        if self.stats is None or state == self._written or not (sampling or errors
                                                                 or self._written):
            return
        self._written = state
        self.stats.write({"role": EXPORTER_STATS, "exporters": [], "spans_ended": 0,
                          **sampling, "closed": closed}, errors)

    def _read(self, source: Source, drain: bool) -> None:
        """Take what `source`'s rings hold, as much as its exporters' queues have room for
        (the rest waits in the rings); when it is gone (`drain`), everything, waiting up to
        DRAIN_S for room."""
        deadline = time.monotonic() + DRAIN_S
        while True:
            room = READ_LIMIT if drain and time.monotonic() > deadline else \
                min(READ_LIMIT, source.room())
            taken = [(ring, *ring.read(room)) for ring in source.rings]
            for _, records, _ in taken:
                for record in records:
                    self._route(source, record)
            if any(records for _, records, _ in taken):
                source.pipeline.write_stats()  # before the commit: see the module docstring
            for ring, records, _ in taken:
                ring.commit(len(records))
            if not drain or not any(ring.unread() for ring in source.rings):
                return
            if room < READ_LIMIT:
                time.sleep(POLL_S)

    def _route(self, source: Source, record: rec.SpanRecord) -> None:
        if record.kind == rec.MARK_ERRORS:
            source.errors = {str(k): int(v) for k, v in record.attributes.items()}
            return
        if record.is_span and self.stages is not None:
            self.stages.observe(record.name, (record.end_ns - record.start_ns) / 1e9,
                                record.attributes)
        if self.sampler is not None:
            self.sampler.add((source, record), record)
        elif record.is_span:
            self._export([(source, record)])

    @staticmethod
    def _export(items: list[Item]) -> None:
        for source, record in items:
            try:
                span = readable_span(record, source.resource, source.offset_ns)
            except Exception as e:  # a record of a shape no tracer writes: skipped, counted
                failsafe.count("exporter.record", e, fix="that span is not exported")
                continue
            source.pipeline.span_processor.on_end(span)

    def finish(self) -> None:
        """Every process is gone: the last records out, every pipeline shut down at once."""
        for source in list(self.sources.values()):
            self._close(source)
        if self.sampler is not None:
            self._export(self.sampler.drain())
        if self.stages is not None:
            self.stages.shutdown()
        closing = [threading.Thread(target=source.pipeline.shutdown) for source in self.done]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()
        self._write_own_stats(closed=True)


def main(argv: list[str] | None = None) -> int:
    name, starter = (argv or sys.argv[1:])[:2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the server ends us through it
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    listener.bind(exporter_link.address(name))
    listener.listen(64)
    exporter = Exporter(listener, int(starter), _tail_sampler())
    signal.signal(signal.SIGTERM, lambda *_: setattr(exporter, "stopping", True))
    exporter.run()
    return 0


def _tail_sampler() -> TailSampler[Item] | None:
    """The tail sampler OTEL_TRACES_SAMPLER asks for, or None (head sampling, in the API
    server)."""
    rule = config.load().tail
    return None if rule is None else TailSampler(rule)


if __name__ == "__main__":
    raise SystemExit(main())
