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
_WALK_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # links followed in one walk: the kernel's own limit for one lookup


class UnsafePath(ValueError):
    """A path that another user controls or could swap, or that is not what it must be."""


class _EveryOwner(frozenset[int]):
    """Every uid, as `owners` of a read: for a file the user named themselves (a trace
    `kvscope import` reads), whose owner does not matter but whose kind and size do."""

    def __contains__(self, uid: object) -> bool:
        return True


ANY_OWNER: frozenset[int] = _EveryOwner()


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
    if isinstance(owners, frozenset):
        return owners  # ANY_OWNER stays itself
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
        _refuse(_link_problem(path, link, st, allowed))
    for ancestor in {*absolute.parents, *Path(os.path.realpath(absolute)).parents}:
        try:
            st = os.stat(ancestor)
        except OSError:
            continue
        _refuse(_ancestor_problem(path, ancestor, st, allowed))


def _refuse(problem: str | None) -> None:
    if problem is not None:
        raise UnsafePath(problem)


def _link_problem(path: str | os.PathLike[str], link: Path, st: os.stat_result,
                  owners: frozenset[int]) -> str | None:
    """Why `link`, above `path`, may not be followed: a link of someone else, who could point
    it elsewhere at any time."""
    if not stat.S_ISLNK(st.st_mode) or st.st_uid in owners:
        return None
    return (f"{path}: its parent {link} is a symbolic link of uid {st.st_uid}, who could "
            f"point it elsewhere; name the real directory ({os.path.realpath(link)}) "
            f"after checking who owns it")


def _ancestor_problem(path: str | os.PathLike[str], ancestor: Path, st: os.stat_result,
                      owners: frozenset[int]) -> str | None:
    """Why directory `ancestor` of `path` lets someone else swap what lies below it."""
    if st.st_uid not in owners:
        return (f"{path}: its parent {ancestor} is owned by uid {st.st_uid} ({_describe(st)}), "
                f"who could swap what lies below it; use a directory under one owned by "
                f"{_whose(owners)}")
    if stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"{path}: its parent {ancestor} is writable by other users and not sticky "
                f"({_describe(st)}), so they could replace what lies below it; "
                f"`chmod o-w,g-w {ancestor}` or use another directory")
    return None


def check_private_dir(path: str | os.PathLike[str], owners: Iterable[int] | None = None) -> None:
    """UnsafePath unless `path` is a real directory (not a link) of one of `owners` (default
    `trusted_owners()`), writable by nobody else, under ancestors that pass `check_ancestors`."""
    allowed = _owners(owners)
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafePath(f"{path}: {exc.strerror}; create it or name another directory") from None
    _refuse(_private_problem(path, st, allowed))
    check_ancestors(path, allowed)


def _private_problem(path: str | os.PathLike[str], st: os.stat_result,
                     owners: frozenset[int]) -> str | None:
    """Why `path` (of status `st`, not followed if a link) is no private directory."""
    if stat.S_ISLNK(st.st_mode):
        return (f"{path} is a symbolic link (to {os.path.realpath(path)}); name the real "
                f"directory after checking who owns it")
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in owners:
        return (f"{path} is owned by uid {st.st_uid}, another user (mode {mode:04o}), who could "
                f"read or plant files there; use a directory of your own ({_whose(owners)})")
    if mode & 0o022:
        return (f"{path} has mode {mode:04o} (group/world-writable): other users could plant or "
                f"swap files there; run `chmod 700 {path}` or use another directory")
    return None


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
    """`path`, created 0700 with any missing parents, passing `check_private_dir`.

    The path is walked from / one directory descriptor at a time (`_DirWalk`): each part is
    opened without following a link and checked by fstat of what was opened, each missing part
    made in the descriptor of its checked parent. A part swapped for a link or another user's
    directory after a check is never walked through: nothing is made through it."""
    target = Path(os.path.abspath(path))
    walk = _DirWalk(target, trusted_owners())
    fd, where = walk.root()
    for name in target.parts[1:-1]:
        fd, where = walk.descend(fd, where, name, create=True)
    walk.last(fd, target.name)
    return target


class _DirWalk:
    """One lookup of a directory `target`, part by part, through directory descriptors, with
    the checks of `check_ancestors` on every directory passed and of `check_private_dir` on
    the last: so what is checked is what is used, at no moment a path looked up again.

    Parts are opened O_PATH (search permission on the parent suffices, as for a lookup by
    path) and O_NOFOLLOW: a link is opened itself and followed only when its owner is one of
    `owners` (who chose where it points), its target walked the same way; nothing is made
    below a link but the parts of `target` itself."""

    def __init__(self, target: Path, owners: frozenset[int]) -> None:
        self.target, self.owners, self.links = target, owners, 0

    def root(self) -> tuple[int, Path]:
        """A descriptor of / (checked) and its path."""
        fd = os.open("/", _WALK_FLAGS | os.O_DIRECTORY)
        return self._checked_dir(fd, Path("/")), Path("/")

    def descend(self, parent: int, where: Path, name: str, create: bool) -> tuple[int, Path]:
        """(a descriptor of the directory `name` in `parent` (at `where`), its path), a link
        followed, the part made 0700 if missing and `create`; `parent` is closed."""
        try:
            if name == "..":
                return self._checked_dir(self._open(parent, name, where), where.parent), \
                    where.parent
            path = where / name
            fd = self._open(parent, name, path, create)
            st = os.fstat(fd)
            if not stat.S_ISLNK(st.st_mode):
                return self._checked_dir(fd, path, st), path
            try:
                return self._follow(parent, where, fd, st, path)
            finally:
                os.close(fd)
        finally:
            os.close(parent)

    def last(self, parent: int, name: str) -> None:
        """Open (making it if missing) and check the target itself, `name` in `parent` ("" for
        /, `parent` itself); `parent` is closed."""
        try:
            fd = self._open(parent, name, self.target, create=True) if name else os.dup(parent)
        finally:
            os.close(parent)
        try:
            _refuse(_private_problem(self.target, os.fstat(fd), self.owners))
        finally:
            os.close(fd)

    def _open(self, parent: int, name: str, path: Path, create: bool = False) -> int:
        """What lies at `name` in `parent`, not followed if a link; a missing part made first
        when `create` (and when someone made it meanwhile, what they made, checked like any)."""
        try:
            return os.open(name, _WALK_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise self._unwritable(errno.ENOENT, path) from None
        except OSError as exc:
            raise self._unwritable(exc.errno, path) from None
        try:
            os.mkdir(name, PRIVATE_DIR_MODE, dir_fd=parent)
        except FileExistsError:
            return self._open(parent, name, path)
        except OSError as exc:
            raise self._unwritable(exc.errno, path) from None
        return self._made(parent, name, path)

    def _made(self, parent: int, name: str, path: Path) -> int:
        """The directory this process just made at `name`, given mode 0700 through its own
        descriptor (a umask may take the owner's bits too)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=parent)
        except OSError as exc:
            raise self._unwritable(exc.errno, path) from None
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid():
                os.fchmod(fd, PRIVATE_DIR_MODE)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _follow(self, parent: int, where: Path, link: int, st: os.stat_result,
                path: Path) -> tuple[int, Path]:
        """The directory the link `link` (at `path`, in `parent` at `where`) points to, if the
        link is one of `owners`; its target walked part by part, nothing made."""
        _refuse(_link_problem(self.target, path, st, self.owners))
        self.links += 1
        if self.links > _MAX_LINKS:
            raise self._unwritable(errno.ELOOP, path)
        pointed = Path(os.readlink("", dir_fd=link))  # the link opened, not one looked up again
        fd, at = self.root() if pointed.is_absolute() else (os.dup(parent), where)
        for name in pointed.parts[1 if pointed.is_absolute() else 0:]:
            fd, at = self.descend(fd, at, name, create=False)
        return fd, at

    def _checked_dir(self, fd: int, path: Path, st: os.stat_result | None = None) -> int:
        """`fd` if it is a directory passing the ancestors' rule; else closed, UnsafePath."""
        try:
            st = os.fstat(fd) if st is None else st
            if not stat.S_ISDIR(st.st_mode):
                raise self._unwritable(errno.ENOTDIR, path)
            _refuse(_ancestor_problem(self.target, path, st, self.owners))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _unwritable(self, code: int | None, path: Path) -> UnsafePath:
        return UnsafePath(f"{self.target} is not writable ({os.strerror(code or errno.EIO)} "
                          f"creating {path}); name a directory you can write")


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


_LINK = ("{path} is a symbolic link; kvscope reads no file through a link in a place others "
         "may write")


@contextmanager
def open_trusted(path: str | os.PathLike[str], max_bytes: int,
                 owners: Iterable[int] | None = None) -> Iterator[IO[bytes]]:
    """`path` open for reading, if it is a regular file (not a link, a FIFO or a device) of one
    of `owners` (default `trusted_owners()`; ANY_OWNER: anyone's) and at most `max_bytes` long;
    else UnsafePath. What `lstat` shows is not a regular file is refused before it is opened
    (opening a FIFO for reading would wake its writer, opening a device may act); what is
    swapped in meanwhile is opened without following a link or waiting for a writer
    (O_NOFOLLOW | O_NONBLOCK) and refused by `fstat`."""
    allowed = _owners(owners)
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
                owners: frozenset[int], max_bytes: int) -> None:
    """UnsafePath unless `st` is a regular file of one of `owners` (ANY_OWNER: anyone's) within
    `max_bytes`."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(_LINK.format(path=path))
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{path} is not a regular file; remove it or name a regular file")
    if st.st_uid not in owners:
        raise UnsafePath(f"{path} is owned by uid {st.st_uid}, not by {sorted(owners)}: "
                         f"another user could have written it; it was not read")
    if st.st_size > max_bytes:
        raise UnsafePath(f"{path} is {st.st_size} bytes, over the {max_bytes}-byte cap for "
                         f"this file; it was not read")


def read_bytes(path: str | os.PathLike[str], max_bytes: int,
               owners: Iterable[int] | None = None) -> bytes:
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
