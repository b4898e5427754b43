"""How kvscope writes and reads files: one rule, safe on a host other users share.

Why one rule: kvscope runs as root (`sudo kvscope record`, the probes, a tracer inside a root
vLLM) on hosts where other local users can create directories and links in /tmp and /var/tmp.
Whatever another user could have planted or could swap later must be neither followed, nor
trusted, nor served. So:

- a directory kvscope writes into must be owned by this process's user (or root) and not
  writable by group or others, and every existing ancestor must be owned by root or this user
  (a link among them too: its owner could re-point it) and, where group or others may write
  it, sticky (then nobody else can rename our entries); kvscope creates what is missing 0700
  (`private_dir`);
- a file is written to an exclusive temporary name (O_EXCL | O_NOFOLLOW, 0600), flushed to
  disk and renamed into place (`atomic_write`): a reader never sees half a file and a planted
  link is replaced, never written through;
- a file is read only if `lstat` shows a regular file (so a FIFO or a device is never opened),
  then opened with O_NOFOLLOW | O_NONBLOCK, checked again with fstat (a regular file of an
  expected owner: anyone's for data checked after reading, ANY_OWNER) and read up to a size
  cap (`read_bytes`).

What fails the rule raises `UnsafePath`, a one-line message naming the path, what was found
and the fix. This module imports nothing of kvscope: every room uses it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterable, Iterator

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
OUTPUT_FILE_MODE = 0o644  # a file the user named (an export, a report): as readable as their own
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePath(ValueError):
    """A path that another user controls or could swap, or that is not what it must be."""


def trusted_owners() -> frozenset[int]:
    """The owners a process may rely on: its own user and root, and under sudo the user who
    ran sudo (SUDO_UID), who may become root anyway and for whom `sudo kvscope record`
    writes (a run under their home directory)."""
    owners = {os.geteuid(), 0}
    invoker = sudo_invoker()
    if invoker is not None:
        owners.add(invoker[0])
    return frozenset(owners)


def sudo_invoker() -> tuple[int, int] | None:
    """(uid, gid) of the user who ran this root process through sudo, else None."""
    if os.geteuid() != 0:
        return None
    try:
        return int(os.environ["SUDO_UID"]), int(os.environ["SUDO_GID"])
    except (KeyError, ValueError):
        return None


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _owners(owners: Iterable[int] | None) -> frozenset[int]:
    return trusted_owners() if owners is None else frozenset(owners)


def _whose(owners: frozenset[int]) -> str:
    return " or ".join(f"uid {uid}" for uid in sorted(owners))


def check_ancestors(path: str | os.PathLike[str], owners: Iterable[int] | None = None) -> None:
    """UnsafePath unless every existing ancestor of `path` (as written and as resolved) is a
    directory of one of `owners` (default `trusted_owners()`), sticky where group or others
    may write it, and every link among them is one of theirs too."""
    allowed = _owners(owners)
    absolute = Path(os.path.abspath(path))
    for link in absolute.parents:
        try:
            st = os.lstat(link)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in allowed:
            raise UnsafePath(
                f"{path}: its parent {link} is a symbolic link of uid {st.st_uid}, who could "
                f"point it elsewhere; name the real directory ({os.path.realpath(link)}) "
                f"after checking who owns it")
    for ancestor in {*absolute.parents, *Path(os.path.realpath(absolute)).parents}:
        try:
            st = os.stat(ancestor)
        except OSError:
            continue
        if st.st_uid not in allowed:
            raise UnsafePath(
                f"{path}: its parent {ancestor} is owned by uid {st.st_uid} ({_describe(st)}), "
                f"who could swap what lies below it; use a directory under one owned by "
                f"{_whose(allowed)}")
        if stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafePath(
                f"{path}: its parent {ancestor} is writable by other users and not sticky "
                f"({_describe(st)}), so they could replace what lies below it; "
                f"`chmod o-w,g-w {ancestor}` or use another directory")


def check_private_dir(path: str | os.PathLike[str], owners: Iterable[int] | None = None) -> None:
    """UnsafePath unless `path` is a real directory (not a link) of one of `owners` (default
    `trusted_owners()`), writable by nobody else, under ancestors that pass `check_ancestors`."""
    allowed = _owners(owners)
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafePath(f"{path}: {exc.strerror}; create it or name another directory") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{path} is a symbolic link (to {os.path.realpath(path)}); name the "
                         f"real directory after checking who owns it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a directory")
    if st.st_uid not in allowed:
        raise UnsafePath(
            f"{path} is owned by uid {st.st_uid}, another user (mode "
            f"{stat.S_IMODE(st.st_mode):04o}), who could read or plant files there; use a "
            f"directory of your own ({_whose(allowed)})")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UnsafePath(
            f"{path} has mode {mode:04o} (group/world-writable): other users could plant or "
            f"swap files there; run `chmod 700 {path}` or use another directory")
    check_ancestors(path, allowed)


def missing_parts(path: str | os.PathLike[str]) -> list[Path]:
    """The parts of `path` (absolute) that do not exist yet, outermost first: what
    `private_dir(path)` would create."""
    missing = []
    probe = Path(os.path.abspath(path))
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    return missing[::-1]


def private_dir(path: str | os.PathLike[str]) -> Path:
    """`path`, created 0700 with any missing parents, after `check_private_dir`. The existing
    ancestors are checked before anything is created, so nothing is made through a link or
    in a directory another user controls."""
    target = Path(os.path.abspath(path))
    check_ancestors(target)
    for directory in missing_parts(target):
        try:
            os.mkdir(directory, PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by someone: checked below like any existing directory
        except OSError as exc:
            raise UnsafePath(f"{target} is not writable ({exc.strerror} creating {directory}); "
                             f"name a directory you can write") from None
        os.chmod(directory, PRIVATE_DIR_MODE)  # a umask may take the owner's bits too
    check_private_dir(target)
    return target


def hand_over(path: str | os.PathLike[str], uid: int, gid: int) -> None:
    """Give `path` and everything below it to uid:gid, changing links themselves and never
    descending through one: for a tree this process made (`sudo kvscope record` hands the run
    to the user who ran sudo)."""
    os.chown(path, uid, gid, follow_symlinks=False)
    for top, directories, names in os.walk(path):
        for name in (*directories, *names):
            os.chown(os.path.join(top, name), uid, gid, follow_symlinks=False)


@contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: int = PRIVATE_FILE_MODE) -> Iterator[IO[bytes]]:
    """A binary file that becomes `path` only when the block ends without an exception.

    The temporary file is created exclusively (mkstemp: O_EXCL | O_NOFOLLOW) in `path`'s own
    directory, flushed to disk, given `mode`, then renamed over `path`; a link planted at
    `path` is replaced, not followed. The directory itself is the caller's to check."""
    target = Path(path)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            os.fchmod(file.fileno(), mode)
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@contextmanager
def locked(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (made 0600 if missing) for the block: the
    writers of one shared thing take turns. The lock file is opened without following a link
    and without truncating: whatever was planted in its place is refused, never written."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     PRIVATE_FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symbolic link; kvscope opens no lock through a link: "
                             f"remove it after checking who planted it") from None
        raise
    with os.fdopen(fd, "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def atomic_write(path: str | os.PathLike[str], data: bytes | str,
                 mode: int = PRIVATE_FILE_MODE) -> None:
    """Write `data` (str as UTF-8) to `path` through `atomic_writer`."""
    with atomic_writer(path, mode) as file:
        file.write(data.encode() if isinstance(data, str) else data)


class AnyOwner:
    """The `owners` of a file whose every value is checked as untrusted after reading (a run
    copied from another host or written by another user, read as data): any owner will do,
    but it must still be a regular file within its cap."""


ANY_OWNER = AnyOwner()
Owners = Iterable[int] | AnyOwner | None  # None: trusted_owners()
_LINK = ("{path} is a symbolic link; kvscope reads no file through a link in a place others "
         "may write")


@contextmanager
def open_trusted(path: str | os.PathLike[str], max_bytes: int,
                 owners: Owners = None) -> Iterator[IO[bytes]]:
    """`path` open for reading, if it is a regular file (not a link, a FIFO or a device) of one
    of `owners` (default `trusted_owners()`; ANY_OWNER: anyone's) and at most `max_bytes` long;
    else UnsafePath. What `lstat` shows is not a regular file is refused before it is opened
    (opening a FIFO for reading would wake its writer, opening a device may act); what is
    swapped in meanwhile is opened without following a link or waiting for a writer
    (O_NOFOLLOW | O_NONBLOCK) and refused by `fstat`."""
    allowed = None if isinstance(owners, AnyOwner) else frozenset(
        trusted_owners() if owners is None else owners)
    _check_file(path, os.lstat(path), allowed, max_bytes)
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link as the last component
            raise UnsafePath(_LINK.format(path=path)) from None
        raise
    try:
        _check_file(path, os.fstat(fd), allowed, max_bytes)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as file:
        yield file


def _check_file(path: str | os.PathLike[str], st: os.stat_result,
                owners: frozenset[int] | None, max_bytes: int) -> None:
    """UnsafePath unless `st` is a regular file of one of `owners` (None: anyone's) within
    `max_bytes`."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(_LINK.format(path=path))
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{path} is not a regular file; remove it or name a regular file")
    if owners is not None and st.st_uid not in owners:
        raise UnsafePath(f"{path} is owned by uid {st.st_uid}, not by {sorted(owners)}: "
                         f"another user could have written it; it was not read")
    if st.st_size > max_bytes:
        raise UnsafePath(f"{path} is {st.st_size} bytes, over the {max_bytes}-byte cap for "
                         f"this file; it was not read")


def read_bytes(path: str | os.PathLike[str], max_bytes: int, owners: Owners = None) -> bytes:
    """The contents of `path`, read through `open_trusted` (a file that grows past the cap
    while being read is refused too)."""
    with open_trusted(path, max_bytes, owners) as file:
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafePath(f"{path} grew past the {max_bytes}-byte cap while being read; "
                         f"it was not read")
    return data


def copy_trusted(source: str | os.PathLike[str], target: str | os.PathLike[str],
                 max_bytes: int, owners: Iterable[int] | None = None) -> None:
    """Copy one file `source` -> `target` under both rules: read through `open_trusted`,
    written through `atomic_writer`."""
    data = read_bytes(source, max_bytes, owners)
    atomic_write(target, data)
