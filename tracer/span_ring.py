# SPDX-License-Identifier: Apache-2.0
"""A ring of span records in shared memory: one serving thread writes, the exporter reads.

The memory is an anonymous memfd, so no file name exists that another user could plant or
open; its descriptor reaches the exporter process over a Unix socket (tracer/exporter_link.py).
One writer per ring (each serving thread has its own, tracer/recorder.py), so writing takes no
lock: the writer packs a record where its head points and then publishes the new head; the
reader decodes up to that head and publishes its tail when it has accounted for what it took.
When the reader is behind (a slow or dead exporter) a record that does not fit is dropped and
counted in the ring itself, never waited for. Records never wrap: one that does not fit before
the end is preceded by a pad to it.

Layout: a control page (the writer's words, then the reader's on their own cache line), then
`capacity` bytes of records, a power of two.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct

from kvscope.contract import span_record as rec

CONTROL = 4096
MAGIC = 0x6B7673636F706531  # "kvscope1"
WRITER = struct.Struct("<QQQQQQ")  # magic, capacity, head, written, dropped, writer pid
PUBLISH = struct.Struct("<QQ")  # head, written: one store
PUBLISH_AT = 16
DROPPED_AT = 32
READER = struct.Struct("<QQ")  # tail, taken
READER_AT = 64
MIN_CAPACITY, MAX_CAPACITY = 1 << 16, 1 << 30


class RingError(ValueError):
    """A descriptor that is not a ring this module made (wrong kind, size or magic)."""


class Ring:
    """One side of a ring: `create` makes it (the writer), `attach` maps a received one."""

    def __init__(self, fd: int, memory: mmap.mmap, capacity: int) -> None:
        self.fd = fd
        self.memory = memory
        self.capacity = capacity
        self._mask = capacity - 1
        self._view = memoryview(memory)
        self._head, self._written, self._dropped = WRITER.unpack_from(memory)[2:5]
        self._tail, self._taken = READER.unpack_from(memory, READER_AT)
        self._pending = self._tail
        self.max_record = capacity // 4

    @classmethod
    def create(cls, capacity: int) -> "Ring":
        if capacity & (capacity - 1) or not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
            raise RingError(f"ring capacity {capacity} is not a power of two in "
                            f"[{MIN_CAPACITY}, {MAX_CAPACITY}]")
        fd = os.memfd_create("kvscope-spans", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, CONTROL + capacity)
            memory = mmap.mmap(fd, CONTROL + capacity)
        except BaseException:
            os.close(fd)
            raise
        WRITER.pack_into(memory, 0, MAGIC, capacity, 0, 0, 0, os.getpid())
        return cls(fd, memory, capacity)

    @classmethod
    def attach(cls, fd: int) -> "Ring":
        """The ring behind a received descriptor (owned by the caller); RingError when it is
        not one: a regular file (a memfd) of a ring's size with the ring's magic."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < CONTROL + MIN_CAPACITY:
            raise RingError(f"descriptor {fd} is not a span ring (mode {info.st_mode:o}, "
                            f"{info.st_size} bytes)")
        memory = mmap.mmap(fd, info.st_size)
        magic, capacity = WRITER.unpack_from(memory)[:2]
        if magic != MAGIC or capacity & (capacity - 1) or CONTROL + capacity != info.st_size:
            memory.close()
            raise RingError(f"descriptor {fd} is not a span ring (magic {magic:#x}, capacity "
                            f"{capacity}, {info.st_size} bytes)")
        return cls(fd, memory, capacity)

    # The writer's side: one thread only.

    def put(self, name: int, kind: int, flags: int, trace_id: int, span_id: int, parent: int,
            start_ns: int, end_ns: int, values: bytes) -> bool:
        """Append one record; False (and counted dropped) when the reader is too far behind."""
        size = len(values)
        length = (rec.HEADER.size + size + 7) & ~7
        head = self._head
        position = head & self._mask
        to_end = self.capacity - position
        needed = length if length <= to_end else length + to_end
        if self.capacity - (head - self._tail) < needed or length > self.max_record:
            self._tail = READER.unpack_from(self.memory, READER_AT)[0]
            if self.capacity - (head - self._tail) < needed or length > self.max_record:
                self._dropped += 1
                struct.pack_into("<Q", self.memory, DROPPED_AT, self._dropped)
                return False
        if length > to_end:
            rec.PREFIX.pack_into(self.memory, CONTROL + position, to_end, 0, rec.PAD, 0)
            head += to_end
            position = 0
        trace_lo = trace_id & 0xFFFFFFFFFFFFFFFF
        at = CONTROL + position
        rec.HEADER.pack_into(self.memory, at, length, name, kind, flags, trace_id >> 64,
                             trace_lo, span_id, parent, start_ns, end_ns,
                             rec.checksum(values, trace_lo, span_id, start_ns, end_ns), size)
        self._view[at + rec.HEADER.size:at + rec.HEADER.size + size] = values
        self._head = head + length
        self._written += 1
        PUBLISH.pack_into(self.memory, PUBLISH_AT, self._head, self._written)
        return True

    # The reader's side: one exporter only.

    def counts(self) -> tuple[int, int, int]:
        """(records written, records dropped because the ring was full, records taken)."""
        _, _, _, written, dropped, _ = WRITER.unpack_from(self.memory)
        return written, dropped, self._taken

    def read(self, limit: int) -> tuple[list[rec.SpanRecord], bool]:
        """Up to `limit` records past the tail, not yet committed; and whether reading stopped
        at a record that does not check yet (a writer mid-record, or a damaged ring)."""
        head = PUBLISH.unpack_from(self.memory, PUBLISH_AT)[0]
        tail, out = self._tail, list[rec.SpanRecord]()
        if head - tail > self.capacity or head < tail:
            return out, True  # a head no writer of this ring could publish
        while tail < head and len(out) < limit:
            position = tail & self._mask
            to_end = self.capacity - position
            length, _, kind, _ = rec.PREFIX.unpack_from(self.memory, CONTROL + position)
            if kind == rec.PAD and length == to_end:
                tail += length
                continue
            try:
                record, length = rec.decode(
                    self._view[CONTROL + position:CONTROL + position + min(to_end, head - tail)])
            except rec.RecordError:
                self._pending = tail
                return out, True
            out.append(record)
            tail += length
        self._pending = tail
        return out, False

    def unread(self) -> int:
        """Bytes published and not yet committed."""
        return PUBLISH.unpack_from(self.memory, PUBLISH_AT)[0] - self._tail

    def commit(self, records: int) -> None:
        """Free what the last `read` returned (`records` of them): the writer may reuse it."""
        self._tail = self._pending
        self._taken += records
        READER.pack_into(self.memory, READER_AT, self._tail, self._taken)

    def close(self) -> None:
        self._view.release()
        self.memory.close()
        os.close(self.fd)
