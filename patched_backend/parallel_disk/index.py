# SPDX-License-Identifier: Apache-2.0
"""In-memory index of the chunk files: LRU order, pins, capacity accounting with reservations.

One short lock guards metadata only; no I/O happens under it, so it never serialises reads.
Space is reserved when a write is admitted (evicting LRU, unpinned chunks as needed) and
turned into used space when the file is published, so the byte budget holds with writes in
flight.
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Optional

from kvscope.patched_backend.parallel_disk.chunkfile import ChunkHeader


@dataclass
class Entry:
    """One published chunk file."""

    key: Hashable
    path: str
    header: ChunkHeader
    file_size: int
    identity: tuple[int, int, int]  # st_dev, st_ino, st_size at publication or scan
    pins: int = 0


class ChunkIndex:
    """Key -> Entry in LRU order (oldest first) with a byte capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self._used = 0
        self._reserved = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Optional[Entry]:
        """Entry for ``key`` without changing its LRU position."""
        with self._lock:
            return self._entries.get(key)

    def prefix(self, keys: list[Hashable], pin: bool) -> int:
        """How many leading ``keys`` are present; pins them when ``pin``."""
        with self._lock:
            count = 0
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    break
                entry.pins += pin
                count += 1
            return count

    def acquire(self, keys: list[Hashable]) -> list[Entry]:
        """Entries of the leading present ``keys``, each pinned until ``unpin_all``."""
        with self._lock:
            found = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    break
                entry.pins += 1
                found.append(entry)
            return found

    def unpin_all(self, entries: list[Entry]) -> None:
        """Release pins taken by ``acquire`` (entries may have been removed meanwhile)."""
        with self._lock:
            for entry in entries:
                entry.pins = max(0, entry.pins - 1)

    def pin(self, key: Hashable, delta: int) -> bool:
        """Add ``delta`` to the pin count (never below 0); False when absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.pins = max(0, entry.pins + delta)
            return True

    def touch(self, keys: list[Hashable]) -> None:
        """Mark ``keys`` most recently used."""
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._entries.move_to_end(key)

    def reserve(self, nbytes: int) -> Optional[list[Entry]]:
        """Reserve space for a new chunk, evicting LRU unpinned entries.

        Returns the evicted entries (their files are the caller's to delete), or None when the
        space cannot be found (nothing reserved, nothing evicted).
        """
        with self._lock:
            excess = self._used + self._reserved + nbytes - self.capacity
            if excess <= 0:
                self._reserved += nbytes
                return []
            victims, freed = [], 0
            for entry in self._entries.values():
                if freed >= excess:
                    break
                if entry.pins == 0:
                    victims.append(entry)
                    freed += entry.file_size
            if freed < excess:
                return None
            for entry in victims:
                del self._entries[entry.key]
                self._used -= entry.file_size
            self._reserved += nbytes
            return victims

    def release(self, nbytes: int) -> None:
        """Give back a reservation whose write failed."""
        with self._lock:
            self._reserved -= nbytes

    def publish(self, entry: Entry, reserved: int) -> Optional[Entry]:
        """Insert a written chunk, consuming its reservation; returns a replaced entry."""
        with self._lock:
            self._reserved -= reserved
            old = self._entries.pop(entry.key, None)
            if old is not None:
                self._used -= old.file_size
            self._entries[entry.key] = entry
            self._used += entry.file_size
            return old

    def add_scanned(self, entries: list[Entry]) -> list[Entry]:
        """Load entries found at start-up (oldest first); returns those over capacity."""
        dropped = []
        with self._lock:
            for entry in entries:
                if self._used + entry.file_size > self.capacity:
                    dropped.append(entry)
                    continue
                self._entries[entry.key] = entry
                self._used += entry.file_size
        return dropped

    def remove(self, key: Hashable, only: Optional[Entry] = None) -> Optional[Entry]:
        """Drop ``key`` (only if it is still ``only``, when given); returns the dropped entry."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or (only is not None and entry is not only):
                return None
            del self._entries[key]
            self._used -= entry.file_size
            return entry

    def used_bytes(self) -> int:
        """Bytes of published chunk files."""
        with self._lock:
            return self._used
