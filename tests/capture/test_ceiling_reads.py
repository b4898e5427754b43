"""The ceiling's raw reader opens only regular files, never through a link, and a FIFO among
them is refused at once (its open would otherwise wait for a writer forever)."""

from __future__ import annotations

import errno
import os

import pytest

from kvscope.capture import ceiling

MIB = 1 << 20


def test_a_link_among_the_files_is_refused_not_read_through(tmp_path):
    """Before: read through the link, here to a file the caller never named."""
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * MIB)
    link = tmp_path / "chunk.kvc"
    link.symlink_to(target)
    with pytest.raises(OSError) as refused:
        ceiling.read_files([link], MIB, 1)
    assert refused.value.errno == errno.ELOOP and refused.value.filename == str(link)


@pytest.mark.timeout(30)  # the hang it guards against, not a timing
def test_a_fifo_among_the_files_is_refused_without_waiting_for_a_writer(tmp_path):
    """Before: the open waited for a writer that never came."""
    fifo = tmp_path / "chunk.kvc"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as refused:
        ceiling.read_files([fifo], MIB, 1)
    assert refused.value.errno == errno.EINVAL and refused.value.filename == str(fifo)
