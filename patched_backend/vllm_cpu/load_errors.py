"""Chunks that fail after the pipelined transfer took them, reported to vLLM as load errors.

vLLM's KV-connector API has one way for a connector to say that blocks it promised were not
loaded: after every forward the worker asks `get_block_ids_with_load_errors()` and, with
`kv_load_failure_policy: recompute`, recomputes those blocks (with `fail`, fails the request);
stale KV is never used. LMCache's connector answers from failures LMCache itself saw. A chunk
that kvscope's pipelined transfer (parallel_disk/pipelined_connector.py) gave up on after
LMCache's retrieve counted it as read is one LMCache never sees, so kvscope adds its blocks to
that answer: `install()` wraps the method on vLLM's LMCache connector class
(`upstream.LMCACHE_CONNECTOR_LOAD_ERRORS`, public API) with one that returns LMCache's blocks and
kvscope's. No LMCache internals are touched.

The transfer hands chunks out before their reads end only while this route is proven live
(`ready()`): vLLM has asked for load errors through the wrapper in this process at least once,
and the block size (to turn the failed tokens' slots into blocks) is known.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import wrapt
from opentelemetry.instrumentation.utils import unwrap

from kvscope.contract import upstream

logger = logging.getLogger(__name__)
_SURFACE = upstream.LMCACHE_CONNECTOR_LOAD_ERRORS
_lock = threading.Lock()


@dataclass
class _Route:
    """What is known about the route to vLLM in this process."""

    block_size: int = 0  # vLLM's tokens per block, from its config at install
    asked: bool = False  # vLLM has asked through the wrapper: the route is live
    failed: set[int] = field(default_factory=set)  # blocks not yet handed to vLLM
    reported: int = 0  # blocks reported since the process started


_route = _Route()


def install() -> None:
    """Wrap vLLM's LMCache connector's load-error method (once) and note vLLM's block size.
    Called as the connector is made, inside vLLM's worker set-up (where its config is
    current); does nothing where vLLM's LMCache connector is not in use."""
    module = sys.modules.get(_SURFACE.module)
    owner = getattr(module, _SURFACE.owner, None) if module is not None else None
    if owner is None:
        return
    if not isinstance(getattr(owner, _SURFACE.name), wrapt.ObjectProxy):
        wrapt.wrap_function_wrapper(owner, _SURFACE.name, _with_kvscope_failures)
    config = upstream.CURRENT_CONFIG.resolve()()
    block_size = int(getattr(getattr(config, "cache_config", None), "block_size", 0) or 0)
    if block_size:
        _route.block_size = block_size


def uninstall() -> None:
    """vLLM's method is its own again (the plugin's `unregister`)."""
    module = sys.modules.get(_SURFACE.module)
    owner = getattr(module, _SURFACE.owner, None) if module is not None else None
    if owner is not None and isinstance(getattr(owner, _SURFACE.name), wrapt.ObjectProxy):
        unwrap(owner, _SURFACE.name)
    with _lock:
        _route.failed.clear()
        _route.block_size, _route.asked = 0, False


def ready() -> bool:
    """Whether a failure reported now reaches vLLM: it has asked through the wrapper."""
    return _route.asked and _route.block_size > 0


def report(kwargs: dict[str, Any], start: int, end: int) -> bool:
    """Tokens [start, end) of the retrieve called with `kwargs` were not loaded: their blocks
    go to vLLM with its next question. False when that cannot happen (not ready)."""
    slot_mapping = kwargs.get("slot_mapping")
    if not ready() or slot_mapping is None:
        return False
    slots = slot_mapping[start:end].to("cpu").long()
    blocks = {int(b) for b in (slots // _route.block_size).unique().tolist()}
    with _lock:
        _route.failed.update(blocks)
        _route.reported += len(blocks)
    logger.warning("kvscope: request %s: tokens %d-%d failed to load after their copy began; "
                   "%d blocks reported to vLLM as load errors", kwargs.get("req_id"), start,
                   end, len(blocks))
    return True


def reported_blocks() -> int:
    """Blocks reported since the process started (a live test reads it)."""
    return _route.reported


def _with_kvscope_failures(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> set[int]:
    blocks = set(wrapped(*args, **kwargs))
    with _lock:
        _route.asked = True
        blocks |= _route.failed
        _route.failed.clear()
    return blocks
