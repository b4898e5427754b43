"""The instrumentor pattern: instrument / uninstrument / re-instrument, and off is off."""

from __future__ import annotations

import subprocess
import sys

import pytest
import wrapt

from kvscope.tracer.instrumentor import TARGETS, KvscopeInstrumentor, wrapped_targets

SCHEDULER = "vllm.v1.core.sched.scheduler"
DISK = "lmcache.v1.storage_backend.local_disk_backend"


@pytest.fixture
def loaded():
    """The real classes the instrumentor wraps (imported before instrumenting)."""
    import importlib

    scheduler = importlib.import_module(SCHEDULER).Scheduler
    disk = importlib.import_module(DISK).LocalDiskBackend
    originals = {(scheduler, "schedule"): scheduler.__dict__["schedule"],
                 (disk, "read_file"): disk.__dict__["read_file"]}
    yield originals
    if KvscopeInstrumentor().is_instrumented_by_opentelemetry:
        KvscopeInstrumentor().uninstrument()


def _is_wrapped(owner: type, name: str) -> bool:
    return isinstance(owner.__dict__[name], wrapt.ObjectProxy)


def test_instrument_uninstrument_reinstrument(loaded):
    instrumentor = KvscopeInstrumentor()
    instrumentor.instrument()
    assert all(_is_wrapped(owner, name) for owner, name in loaded)
    instrumentor.uninstrument()
    assert all(owner.__dict__[name] is original for (owner, name), original in loaded.items())
    assert wrapped_targets() == []
    instrumentor.instrument()
    assert all(_is_wrapped(owner, name) for owner, name in loaded)


def test_instrumenting_twice_wraps_once(loaded, caplog):
    KvscopeInstrumentor().instrument()
    before = wrapped_targets()
    KvscopeInstrumentor().instrument()
    assert wrapped_targets() == before
    assert len(before) == len(set(before))
    assert "already instrumented" in caplog.text


def test_every_target_is_listed_with_vllm_and_lmcache_surfaces():
    """Their existence in the pinned versions is tests/contract/test_upstream.py's check."""
    from kvscope.contract import upstream

    assert {t.surface for t in TARGETS} <= {*upstream.VLLM, *upstream.LMCACHE}


def _python(code: str, **env: str) -> str:
    import os

    clean = {k: v for k, v in os.environ.items() if k != "KVSCOPE_TRACING"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**clean, **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


PROBE = f"""
import sys, wrapt
import kvscope.tracer.vllm_plugin as plugin
plugin.register()
from {DISK} import LocalDiskBackend
print("kvscope.tracer.instrumentor" in sys.modules,
      isinstance(LocalDiskBackend.__dict__["read_file"], wrapt.ObjectProxy))
"""


def test_plugin_off_is_off_nothing_imported_nothing_wrapped():
    assert _python(PROBE) == "False False"


def test_plugin_on_wraps_modules_imported_later():
    assert _python(PROBE, KVSCOPE_TRACING="1") == "True True"
