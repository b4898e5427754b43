"""vllm_cpu/load_errors.py on vLLM's own LMCache connector class and a real vLLM config.

The connector's LMCache adapter (which needs a loaded model) is a stand-in answering LMCache's
own failed blocks; the live round trip (test_kv_roundtrip.py) runs the whole route in a real
vLLM-CPU worker, where vLLM recomputes what kvscope reports."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
import wrapt

from kvscope.contract import upstream
from kvscope.patched_backend.vllm_cpu import load_errors

SURFACE = upstream.LMCACHE_CONNECTOR_LOAD_ERRORS
BLOCK = 16


@pytest.fixture
def connector_class():
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config

    owner = getattr(importlib.import_module(SURFACE.module), SURFACE.owner)
    original = owner.__dict__[SURFACE.name]
    with set_current_vllm_config(VllmConfig(cache_config=CacheConfig(block_size=BLOCK))):
        load_errors.install()
    yield owner
    load_errors.uninstall()
    assert owner.__dict__[SURFACE.name] is original


def _connector(owner, lmcache_failed: set[int]):
    """vLLM's connector object around a stand-in for LMCache's adapter."""
    connector = object.__new__(owner)
    connector._lmcache_engine = SimpleNamespace(
        get_block_ids_with_load_errors=lambda: set(lmcache_failed))
    return connector


def test_failures_reach_vllm_only_once_it_asks_through_the_wrapper(connector_class):
    assert isinstance(connector_class.__dict__[SURFACE.name], wrapt.ObjectProxy)
    slots = {"slot_mapping": torch.arange(10 * BLOCK) + 4 * BLOCK, "req_id": "r"}
    assert not load_errors.ready()
    assert not load_errors.report(slots, 0, BLOCK)  # nobody would hear it: the get must block
    connector = _connector(connector_class, {1})
    assert connector.get_block_ids_with_load_errors() == {1}
    assert load_errors.ready()
    before = load_errors.reported_blocks()
    # tokens [2 blocks, 5 blocks) sit in blocks 6, 7, 8 (the slots start at block 4)
    assert load_errors.report(slots, 2 * BLOCK, 5 * BLOCK)
    assert load_errors.reported_blocks() - before == 3
    assert connector.get_block_ids_with_load_errors() == {1, 6, 7, 8}
    assert connector.get_block_ids_with_load_errors() == {1}  # each failure is reported once


def test_installing_twice_wraps_once(connector_class):
    wrapped = connector_class.__dict__[SURFACE.name]
    load_errors.install()
    assert connector_class.__dict__[SURFACE.name] is wrapped
