# SPDX-License-Identifier: Apache-2.0
"""KvscopeInstrumentor: wraps vLLM and LMCache where a request's TTFT is spent.

Usage (in each vLLM process; tracer.vllm_plugin does this when KVSCOPE_TRACING=1)::

    from kvscope.tracer.instrumentor import KvscopeInstrumentor
    KvscopeInstrumentor().instrument()
    ...
    KvscopeInstrumentor().uninstrument()

Nothing is imported here: each target is wrapped by a post-import hook when vLLM or LMCache
import its module (importing LMCache's connector early breaks vLLM's start), or at once if the
module is already loaded. Only public interfaces are wrapped: vLLM's engine front end
(AsyncLLM, InputProcessor, OutputProcessor), its scheduler, the KV-connector interface of
whatever connector vLLM's factory creates (the same calls on both model runners), and
LMCache's engine and disk backend. Uninstrumenting unwraps every target; hooks that fire later do
nothing until the next `instrument()`. While uninstrumented, no wrapper is installed at all.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Collection

import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.utils import unwrap

from kvscope.tracer import failsafe, frontend, ledger, pipeline, scheduler, storage, worker
from kvscope.tracer.package import _instruments

logger = logging.getLogger(__name__)
_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
_OUTPUTS = "vllm.v1.engine.output_processor"
_TRANSFER_STATE = "vllm.distributed.kv_transfer.kv_transfer_state"
_DISK = "lmcache.v1.storage_backend.local_disk_backend"
_STORAGE = "lmcache.v1.storage_backend.storage_manager"
_CPU = "lmcache.v1.storage_backend.local_cpu_backend"


@dataclass(frozen=True)
class Target:
    module: str
    owner: str  # class name in module
    method: str
    wrapper: Callable[..., Any]


TARGETS = (
    Target("vllm.v1.engine.async_llm", "AsyncLLM", "add_request", frontend.on_add_request),
    Target("vllm.v1.engine.input_processor", "InputProcessor", "assign_request_id",
           frontend.on_assign_request_id),
    Target(_OUTPUTS, "OutputProcessor", "process_outputs", frontend.on_process_outputs),
    Target(_OUTPUTS, "OutputProcessor", "abort_requests", frontend.on_abort_requests),
    Target("vllm.v1.core.sched.scheduler", "Scheduler", "add_request", scheduler.on_add_request),
    Target("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", scheduler.on_schedule),
    Target("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output",
           scheduler.on_update_from_output),
    Target("lmcache.v1.cache_engine", "LMCacheEngine", "store", worker.on_store),
    Target(_DISK, "LocalDiskBackend", "batched_get_blocking", storage.on_stock_get),
    Target(_DISK, "LocalDiskBackend", "get_blocking", storage.on_stock_get),
    Target(_DISK, "LocalDiskBackend", "batched_get_non_blocking",
           storage.on_stock_get_non_blocking),
    Target(_DISK, "LocalDiskBackend", "read_file", storage.on_stock_read_file),
    # the chunk ledger (tracer/ledger.py): the worker's lookups, stores and CPU evictions
    Target("lmcache.v1.cache_engine", "LMCacheEngine", "lookup", ledger.on_engine_lookup),
    Target(_STORAGE, "StorageManager", "batched_contains", ledger.on_batched_contains),
    Target(_STORAGE, "StorageManager", "batched_put", ledger.on_batched_put),
    Target(_CPU, "LocalCPUBackend", "remove", ledger.on_cpu_remove),
)

_hooked: set[str] = set()  # modules with a post-import hook registered in this process
_wrapped: list[tuple[type, str]] = []
_state = {"active": False}
_listener = storage.ParallelReadListener()
_ledger_listener = ledger.LedgerListener()


def wrap(owner: type, method: str, wrapper: Callable[..., Any]) -> None:
    """Wrap `owner.method` once (a second call for the same pair does nothing), guarded so
    no kvscope error reaches vLLM (tracer/failsafe.py)."""
    if (owner, method) in _wrapped or not _state["active"]:
        return
    wrapt.wrap_function_wrapper(owner, method,
                                failsafe.guard(f"{owner.__name__}.{method}", wrapper))
    _wrapped.append((owner, method))


def _on_retrieve(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """kv.load around LMCacheEngine.retrieve; wraps the engine's GPU connector on first use."""
    connector = getattr(instance, "gpu_connector", None)
    if connector is not None and hasattr(connector, "batched_to_gpu"):
        wrap(type(connector), "batched_to_gpu", worker.on_to_device)
    return worker.on_retrieve(wrapped, instance, args, kwargs)


_RETRIEVE = Target("lmcache.v1.cache_engine", "LMCacheEngine", "retrieve", _on_retrieve)

# The KV connector interface (KVConnectorBase_V1) both model runners call, by role. Wrapped on
# the class of whatever connector vLLM creates (LMCacheConnectorV1, MultiConnector, ...), so
# kvscope needs no change to the user's --kv-transfer-config.
SCHEDULER_HOOKS = {"get_num_new_matched_tokens": scheduler.on_lookup}
WORKER_HOOKS = {"bind_connector_metadata": worker.on_bind,
                "start_load_kv": worker.on_start_load_kv,
                "finish_forward": worker.on_forward_done,
                "wait_for_save": worker.on_forward_done}


def instrument_connector(connector: Any) -> None:
    """Wrap the interface methods of `connector`'s class for its role (scheduler or worker)."""
    role = getattr(getattr(connector, "role", None), "name", "")
    hooks = {"SCHEDULER": SCHEDULER_HOOKS, "WORKER": WORKER_HOOKS}.get(role, {})
    for method, hook in hooks.items():
        if hasattr(connector, method):
            wrap(type(connector), method, hook)


def _on_create_connector(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """KVConnectorFactory.create_connector: the connector it returns gets its hooks."""
    connector = wrapped(*args, **kwargs)
    instrument_connector(connector)
    return connector


_CONNECTOR = Target(_FACTORY, "KVConnectorFactory", "create_connector", _on_create_connector)
_OWN = (_RETRIEVE, _CONNECTOR)  # targets whose wrappers live here


def _apply(module: ModuleType) -> None:
    if not _state["active"]:
        return
    for target in (*TARGETS, *_OWN):
        if target.module == module.__name__:
            owner = getattr(module, target.owner, None)
            if owner is None or not hasattr(owner, target.method):
                logger.warning("kvscope tracer: %s.%s.%s not found; its span is missing",
                               target.module, target.owner, target.method)
                continue
            wrap(owner, target.method, target.wrapper)
    if module.__name__ == pipeline.DISK_HOOKS:
        module.add_listener(_listener)
        module.add_listener(_ledger_listener)


class KvscopeInstrumentor(BaseInstrumentor):
    """Spans for queue, KV lookup, KV load (reads, transfers), prefill, store, first token."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        _state["active"] = True
        modules = {t.module for t in (*TARGETS, *_OWN)} | {pipeline.DISK_HOOKS}
        for name in sorted(modules):
            if name in sys.modules:
                _apply(sys.modules[name])
            if name not in _hooked:
                _hooked.add(name)
                wrapt.register_post_import_hook(_apply, name)
        transfer = sys.modules.get(_TRANSFER_STATE)
        if transfer is not None and transfer.has_kv_transfer_group():
            instrument_connector(transfer.get_kv_transfer_group())  # made before instrument()

    def _uninstrument(self, **kwargs: Any) -> None:
        _state["active"] = False
        while _wrapped:
            owner, method = _wrapped.pop()
            unwrap(owner, method)
        hooks = sys.modules.get(pipeline.DISK_HOOKS)
        if hooks is not None:
            hooks.remove_listener(_listener)
            hooks.remove_listener(_ledger_listener)
        frontend.forget_all()
        scheduler.forget_all()
        worker.forget_all()


def wrapped_targets() -> list[tuple[type, str]]:
    """What is wrapped right now (for tests and diagnostics)."""
    return list(_wrapped)
