"""The run's KV directory: private, free, and cleaned of only what this run created.

Why: `kvscope run` runs as root on a directory a user names, which may hold the user's own
files, or may be a shared default path someone else prepared. So the directory
(and each parent this run creates) is created 0700 and must be owned by us and not
group/world-writable (the disk backend's own rule, patched_backend/parallel_disk/dirsafety.py);
no other kvscope server may hold it; and at the end only the files that were not there at
the start are deleted (the whole directory only when this run created it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvscope.patched_backend.parallel_disk.dirlock import DirectoryLock
from kvscope.patched_backend.parallel_disk.dirsafety import prepare_private_dir

DEFAULT_ROOT = Path("/var/tmp/kvscope")


class RunKVDir:
    """`RunKVDir.prepare(path)` before the server starts, `cleanup()` after it stopped."""

    def __init__(self, path: Path, created: bool, before: set[tuple[str, int]]) -> None:
        self.path = path
        self.created = created
        self._before = before

    @classmethod
    def prepare(cls, path: Path | None, run_name: str) -> "RunKVDir":
        """Create or check `path` (default /var/tmp/kvscope/kv-<run>); refuse one in use.

        Raises UnsafeDirectory (a ValueError) or DirectoryInUse with one line saying what to do.
        """
        path = Path(os.path.abspath(path or DEFAULT_ROOT / f"kv-{run_name}"))
        created = not path.exists()
        prepare_private_dir(path, "KV directory")
        before = _entries(path)  # before the lock file below: it is this run's to delete
        DirectoryLock(str(path)).acquire().release()  # a clear error now, not a silent miss later
        return cls(path, created, before)

    def cleanup(self) -> None:
        """Delete what this run created: the directory if it made it, else its new files only."""
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for name, inode in _entries(self.path) - self._before:
            target = self.path / name
            try:
                if not target.is_symlink() and target.is_dir():
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    target.unlink()
            except FileNotFoundError:
                pass


def _entries(path: Path) -> set[tuple[str, int]]:
    """(name, inode) of the directory's entries: a file replaced under an old name is new."""
    try:
        with os.scandir(path) as it:
            return {(entry.name, entry.inode()) for entry in it}
    except FileNotFoundError:
        return set()
