# SPDX-License-Identifier: Apache-2.0
"""The KV directory must be private to the serving user, as PostgreSQL requires of its data.

Why: the server often runs as root on a shared host, chunk names are deterministic, and a
served chunk is trusted KV. If another user can write the directory (or owns it) they can
plant chunks the server then serves, swap a name for a symlink, or read cached KV. So the
directory (and every parent this code creates) is created 0700; an existing one must be owned
by the serving user and not group/world-writable, or the backend refuses to start with one
line saying what to fix. Chunk files are created 0600 and opened with O_NOFOLLOW.
"""

# Standard
from pathlib import Path
import os
import stat


class UnsafeDirectory(ValueError):
    """The KV directory cannot be created, or could be written (or is owned) by someone other
    than the server."""


def prepare_private_dir(path: str | os.PathLike[str], what: str = "kvscope.path") -> Path:
    """Create ``path`` (and missing parents) 0700, then ``check_private_dir`` it."""
    target = Path(os.path.abspath(path))
    missing = []
    probe = target
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass  # created meanwhile: checked below like any existing directory
        except OSError as exc:
            raise UnsafeDirectory(f"{what} {target} is not writable ({exc.strerror} creating "
                                  f"{directory}); use a directory you own") from None
        else:
            os.chmod(directory, 0o700)  # the umask could have removed bits, never added
        check_private_dir(directory, what)
    check_private_dir(target, what)
    return target


def check_private_dir(path: str | os.PathLike[str], what: str = "kvscope.path") -> None:
    """UnsafeDirectory (one line: what and how to fix) unless ``path`` is a private directory."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafeDirectory(f"{what} {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectory(f"{what} {path} is a symlink; give the real directory "
                              f"({os.path.realpath(path)}) after checking who owns it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{what} {path} is not a directory")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafeDirectory(
            f"{what} {path} is owned by uid {st.st_uid}, not by the serving user (uid {uid}): "
            f"another user could plant KV chunks there; use a directory you own "
            f"(or `chown {uid} {path}` if you trust its contents)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UnsafeDirectory(
            f"{what} {path} has mode {mode:04o} (group/world-writable): other users could "
            f"plant or replace KV chunks; run `chmod 700 {path}` or use another directory")
