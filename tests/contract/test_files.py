"""The one rule for what a privileged kvscope process writes and reads (contract/files.py),
tried by a real second user (uid 65534) planting directories, links, FIFOs and files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvscope.contract import files
from kvscope.contract.files import UnsafePath


def test_private_dir_creates_every_missing_part_0700(shared_tmp):
    made = files.private_dir(shared_tmp / "a" / "b")
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in (made.parent, made)] == [0o700, 0o700]


def test_a_directory_planted_by_another_user_is_refused(shared_tmp, as_nobody):
    as_nobody("mkdir", "-m", "700", str(shared_tmp / "kvscope-spans"))
    with pytest.raises(UnsafePath, match="owned by uid 65534, another user"):
        files.private_dir(shared_tmp / "kvscope-spans")


def test_a_world_writable_directory_of_ours_is_refused(shared_tmp):
    (shared_tmp / "open").mkdir()
    os.chmod(shared_tmp / "open", 0o777)
    with pytest.raises(UnsafePath, match="mode 0777 .group/world-writable.*chmod 700"):
        files.check_private_dir(shared_tmp / "open")


def test_a_planted_link_to_our_own_directory_is_refused(shared_tmp, as_nobody):
    ours = shared_tmp / "ours"
    ours.mkdir(mode=0o700)
    as_nobody("ln", "-s", str(ours), str(shared_tmp / "spans"))
    with pytest.raises(UnsafePath, match="symbolic link"):
        files.private_dir(shared_tmp / "spans")


def test_a_parent_owned_by_another_user_is_refused_even_if_ours_below(shared_tmp, as_nobody):
    as_nobody("mkdir", "-m", "755", str(shared_tmp / "theirs"))
    ours = shared_tmp / "theirs" / "ours"
    as_nobody("mkdir", "-m", "777", str(ours))
    os.chown(ours, 0, 0)
    os.chmod(ours, 0o700)  # ours and private, but they may rename it and put a link there
    with pytest.raises(UnsafePath, match="parent .*theirs is owned by uid 65534"):
        files.check_private_dir(ours)


def test_a_parent_writable_by_others_without_sticky_bit_is_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(UnsafePath, match="not sticky"):
        files.private_dir(loose / "spans")


@pytest.mark.parametrize(("plant", "refused"), [
    pytest.param(lambda name, victim: ("ln", "-s", str(victim), str(name)),
                 "is a symbolic link of uid 65534", id="link-to-a-root-only-directory"),
    pytest.param(lambda name, victim: ("mkdir", "-m", "777", str(name)),
                 "is owned by uid 65534", id="their-own-directory"),
])
def test_a_part_swapped_by_another_user_just_before_mkdir_gets_nothing_made_through_it(
        shared_tmp, tmp_path, as_nobody, monkeypatch, plant, refused):
    """The race between checking a path and making its missing parts, made deterministic by a
    hook: the first os.mkdir of private_dir first has the second user (uid 65534, a real
    process) plant a link to a root-only directory, or a directory of theirs, at the very name
    about to be made, as a racing attacker could at any moment after a check. Root must
    make nothing through the link nor in their directory."""
    victim = tmp_path / "root-only"
    victim.mkdir(mode=0o700)
    spans = shared_tmp / "spans"
    real_mkdir, swapped = os.mkdir, []

    def mkdir_after_the_swap(path, mode=0o777, **kwargs):
        if not swapped and Path(path).name == spans.name:
            swapped.append(as_nobody(*plant(spans, victim)))
        return real_mkdir(path, mode, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir_after_the_swap)
    with pytest.raises(UnsafePath, match=f"its parent {spans} {refused}"):
        files.private_dir(spans / "stats")
    assert swapped, "the hook ran"
    assert list(victim.iterdir()) == [] and list(spans.iterdir()) == [], \
        "nothing made through the link or in their directory"


def test_atomic_write_replaces_a_link_it_finds_instead_of_writing_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("secret")
    (tmp_path / "out.json").symlink_to(victim)
    files.atomic_write(tmp_path / "out.json", "{}")
    assert victim.read_text() == "secret"
    assert not (tmp_path / "out.json").is_symlink()
    assert stat.S_IMODE(os.stat(tmp_path / "out.json").st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "victim"]


def test_a_failed_write_leaves_neither_file_nor_temporary(tmp_path):
    with pytest.raises(RuntimeError), files.atomic_writer(tmp_path / "x") as f:
        f.write(b"half")
        raise RuntimeError("cut short")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("plant", [
    pytest.param(lambda p: p.symlink_to("/dev/zero"), id="link-to-dev-zero"),
    pytest.param(lambda p: os.mkfifo(p), id="fifo"),
    pytest.param(lambda p: p.mkdir(), id="directory"),
])
def test_read_refuses_what_is_not_a_regular_file_without_blocking(tmp_path, plant):
    plant(tmp_path / "stats.json")
    with pytest.raises(UnsafePath):
        files.read_bytes(tmp_path / "stats.json", 1 << 20)


def test_read_refuses_a_file_of_another_owner(shared_tmp, as_nobody):
    as_nobody("sh", "-c", f"echo '{{}}' > {shared_tmp}/spans.json")
    with pytest.raises(UnsafePath, match="owned by uid 65534"):
        files.read_bytes(shared_tmp / "spans.json", 1 << 20)
    assert files.read_bytes(shared_tmp / "spans.json", 1 << 20, owners={65534}) == b"{}\n"


def test_read_refuses_a_file_over_its_cap(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(UnsafePath, match="101 bytes, over the 100-byte cap"):
        files.read_bytes(tmp_path / "big", 100)
    assert files.read_bytes(tmp_path / "big", 101) == b"x" * 101
