# SPDX-License-Identifier: Apache-2.0
"""A KV connector wrapper that copies each chunk as soon as its own reads are verified.

LMCache's retrieve calls ``batched_to_gpu(memory_objs, starts, ends, **kwargs)`` once per
request, after the storage get. An engine whose connector is this wrapper runs its retrieve as
a pipelined get (``handoff.pipelined_get``, through a wrapper on ``LMCacheEngine.retrieve``),
unless LMCache copies got chunks itself there (``lmcache_config.copies_outside_connector``, and
the engine's own ``save_only_first_rank``): then its gets verify before they return, as any get
outside a pipelined one does. When the kvscope tier handed its chunks out still being read
(handoff.py), this wrapper walks them in order: wait for chunk i, copy chunk i through the
wrapped connector (vLLM-CPU's block copy, or LMCache's CUDA connector: an H2D copy), so the copy
of chunk i overlaps the reads of chunks i+1.., and the request's load ends about when its last
byte is verified plus one chunk's copy. Objects that were not handed out (read before, another
tier) are copied at once. Everything else is the wrapped connector's.

A chunk that fails after it was handed out is not copied, nor are the chunks after it; their
tokens go to the engine as a load error (``LoadErrorSink``; for vLLM, vllm_cpu/load_errors.py
through its KV-connector API), which with vLLM's ``kv_load_failure_policy: recompute`` makes it
recompute them, as it does when a retrieve comes back short. The sink says when it can report
(``sink_ready``): until then every get blocks until its chunks are read, as before.

``copies`` holds the last call's copies ((start_ns, end_ns, bytes) each) so a tracer can record
the transfer without the waits in between (tracer/worker.py).
"""

import importlib
import logging
import operator
import time
from typing import Any, Callable, Optional, Sequence

import wrapt

from kvscope.contract import upstream
from kvscope.patched_backend.parallel_disk import handoff, lmcache_config

logger = logging.getLogger(__name__)


class PipelinedConnector:
    """Wraps a GPU connector (``GPUConnectorInterface``); see the module docstring."""

    def __init__(self, inner: Any, sink: handoff.LoadErrorSink,
                 sink_ready: Optional[Callable[[], bool]] = None) -> None:
        self.inner = inner
        self._sink = sink
        self.sink_ready = sink_ready or (lambda: True)
        self.copies: list[tuple[int, int, int]] = []
        _pipeline_retrieves()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def batched_to_gpu(self, memory_objs: Optional[Sequence[Any]] = None,
                       starts: Optional[Sequence[int]] = None,
                       ends: Optional[Sequence[int]] = None, **kwargs: Any) -> Any:
        objs = list(memory_objs or ())
        held = [handoff.take(obj) for obj in objs]
        self.copies = []
        if not any(held):  # nothing handed out (or a layerwise call): the wrapped connector's
            return self.inner.batched_to_gpu(memory_objs, starts, ends, **kwargs)
        starts, ends = list(starts or ()), list(ends or ())
        handoffs = {id(h[0]): h[0] for h in held if h is not None}
        failed_at: Optional[int] = None
        try:
            for i, obj in enumerate(objs):
                if held[i] is not None:
                    h, slot = held[i]  # type: ignore[misc]
                    if h.wait(slot) is not None:
                        failed_at = i
                        break
                started = time.monotonic_ns()
                self.inner.batched_to_gpu([obj], [starts[i]], [ends[i]], **kwargs)
                self.copies.append((started, time.monotonic_ns(), int(obj.get_size())))
        finally:
            for h in handoffs.values():
                h.finish()
        if failed_at is not None and not self._sink(kwargs, starts[failed_at], ends[-1]):
            logger.error("kvscope: tokens %d-%d failed to load and could not be reported to "
                         "the engine; they hold stale KV", starts[failed_at], ends[-1])
        return None


def _pipeline_retrieves() -> None:
    """Wrap ``LMCacheEngine.retrieve`` once in this process (a no-op for other engines)."""
    surface = upstream.ENGINE_RETRIEVE
    owner = operator.attrgetter(surface.owner)(importlib.import_module(surface.module))
    method = vars(owner)[surface.name]  # as stored: getattr would hand out a bound wrapper
    while isinstance(method, wrapt.ObjectProxy):  # the tracer may have wrapped it too
        if getattr(method, "_self_wrapper", None) is _pipelined_retrieve:
            return
        method = method.__wrapped__
    wrapt.wrap_function_wrapper(surface.module, surface.path, _pipelined_retrieve)


def _pipelined_retrieve(wrapped: Callable[..., Any], engine: Any, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> Any:
    connector = getattr(engine, "gpu_connector", None)
    if not isinstance(connector, PipelinedConnector) or _copies_outside(engine):
        return wrapped(*args, **kwargs)
    with handoff.pipelined_get(connector.sink_ready):
        return wrapped(*args, **kwargs)


def _copies_outside(engine: Any) -> bool:
    """The engine's own switch first (missing, as in a version that renamed it: assume it
    copies), then the reasons its config and model give."""
    return (bool(getattr(engine, "save_only_first_rank", True))
            or lmcache_config.copies_outside_connector(getattr(engine, "config", None),
                                                       getattr(engine, "metadata", None))
            is not None)
