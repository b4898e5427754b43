# SPDX-License-Identifier: Apache-2.0
"""The KV directory must be private to the serving user, as PostgreSQL requires of its data.

Why: the server often runs as root on a shared host, chunk names are deterministic, and a
served chunk is trusted KV. If another user can write the directory or any parent of it (or
owns one), they can plant chunks the server then serves, swap a name or the directory itself
for a symlink, or read cached KV. So the rule is kvscope's one rule for privileged files
(`kvscope.contract.files`): the directory (and every parent this code creates) is created
0700; an existing one must be owned by the serving user and not group/world-writable, and
every parent owned by root or that user (sticky where others may write it), or the backend
refuses to start with one line saying what to fix. Chunk files are created 0600 and opened
with O_NOFOLLOW.
"""

import os
from pathlib import Path

from kvscope.contract import files


class UnsafeDirectory(files.UnsafePath):
    """The KV directory cannot be created, or could be written (or is owned) by someone other
    than the server."""


def prepare_private_dir(path: str | os.PathLike[str], what: str = "kvscope.path") -> Path:
    """Create ``path`` (and missing parents) 0700, then ``check_private_dir`` it."""
    try:
        target = files.private_dir(path)
    except files.UnsafePath as exc:
        raise UnsafeDirectory(f"{what} {exc}") from None
    check_private_dir(target, what)
    return target


def check_private_dir(path: str | os.PathLike[str], what: str = "kvscope.path") -> None:
    """UnsafeDirectory (one line: what and how to fix) unless ``path`` is a private directory
    of the serving user: root's directories are trusted as parents, but the server must own
    (and so be able to write) the KV directory itself."""
    try:
        files.check_private_dir(path)
    except files.UnsafePath as exc:
        raise UnsafeDirectory(f"{what} {exc}") from None
    owner, uid = os.lstat(path).st_uid, os.geteuid()
    if owner != uid:
        raise UnsafeDirectory(
            f"{what} {path} is owned by uid {owner}, not by the serving user (uid {uid}), who "
            f"must own it to store chunks there; use a directory you own (or `chown {uid} "
            f"{path}` if you trust its contents)")
