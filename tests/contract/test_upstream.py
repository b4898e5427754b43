"""Every part of vLLM and LMCache kvscope reaches (contract/upstream.py) exists in the pinned
versions installed here, and the rooms name those parts only through that table."""

from __future__ import annotations

import pytest

from kvscope.contract import upstream

SURFACES = [*upstream.VLLM, *upstream.LMCACHE]


@pytest.mark.parametrize("surface", SURFACES, ids=lambda s: f"{s.module}:{s.path}")
def test_each_surface_exists_in_the_installed_version(surface):
    assert surface.resolve() is not None


def test_the_tables_hold_every_surface_once():
    names = {k for k, v in vars(upstream).items() if isinstance(v, upstream.Surface)}
    assert len(SURFACES) == len(set(SURFACES)) == len(names)
