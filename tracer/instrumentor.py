# SPDX-License-Identifier: Apache-2.0
"""KvscopeInstrumentor: wraps vLLM and LMCache where a request's TTFT is spent.

Usage (in each vLLM process; tracer.vllm_plugin does this when KVSCOPE_TRACING=1)::

    from kvscope.tracer.instrumentor import KvscopeInstrumentor
    KvscopeInstrumentor().instrument()
    ...
    KvscopeInstrumentor().uninstrument()

Nothing is imported here: each target is wrapped by a post-import hook when vLLM or LMCache
import its module (importing LMCache's connector early breaks vLLM's start), or at once if the
module is already loaded. What is wrapped is listed, public or internal, in
contract/upstream.py: vLLM's engine front end (AsyncLLM, InputProcessor, OutputProcessor) and
scheduler (internals), the KV-connector interface of whatever connector vLLM's factory creates
(public: the same calls on both model runners), LMCache's engine (public) and its storage
manager, CPU tier and disk tiers (stock, raw-block, the fs connector). Uninstrumenting unwraps every target; hooks that fire later do
nothing until the next `instrument()`. While uninstrumented, no wrapper is installed at all.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Collection

import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]  # mypy 2.4 reads every name of this module as missing
from opentelemetry.instrumentation.utils import unwrap

from kvscope.contract import upstream
from kvscope.tracer import failsafe, frontend, ledger, pipeline, scheduler, storage, worker
from kvscope.tracer.package import _instruments

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    surface: upstream.Surface  # what is wrapped: module, "Class.method"
    wrapper: Callable[..., Any]


TARGETS = (
    Target(upstream.ASYNC_LLM_ADD_REQUEST, frontend.on_add_request),
    Target(upstream.ASSIGN_REQUEST_ID, frontend.on_assign_request_id),
    Target(upstream.PROCESS_OUTPUTS, frontend.on_process_outputs),
    Target(upstream.ABORT_REQUESTS, frontend.on_abort_requests),
    Target(upstream.SCHEDULER_ADD_REQUEST, scheduler.on_add_request),
    Target(upstream.SCHEDULER_SCHEDULE, scheduler.on_schedule),
    Target(upstream.SCHEDULER_UPDATE, scheduler.on_update_from_output),
    Target(upstream.ENGINE_STORE, worker.on_store),
    Target(upstream.DISK_BATCHED_GET, storage.on_stock_get),
    Target(upstream.DISK_GET, storage.on_stock_get),
    Target(upstream.DISK_GET_NON_BLOCKING, storage.on_stock_get_non_blocking),
    Target(upstream.DISK_READ_FILE, storage.on_stock_read_file),
    # LMCache's other disk paths: the raw-block plugin and the fs connector (tracer/storage.py)
    Target(upstream.RAW_BLOCK_BATCHED_GET, storage.on_peer_get),
    Target(upstream.RAW_BLOCK_GET, storage.on_peer_get),
    Target(upstream.REMOTE_BATCHED_GET, storage.on_peer_get),
    Target(upstream.REMOTE_GET, storage.on_peer_get),
    Target(upstream.FS_READ, storage.on_fs_read),
    # the chunk ledger (tracer/ledger.py): the worker's lookups, stores and CPU evictions
    Target(upstream.ENGINE_LOOKUP, ledger.on_engine_lookup),
    Target(upstream.STORAGE_CONTAINS, ledger.on_batched_contains),
    Target(upstream.STORAGE_PUT, ledger.on_batched_put),
    Target(upstream.CPU_REMOVE, ledger.on_cpu_remove),
    Target(upstream.RAW_BLOCK_PUT, ledger.on_peer_put),
    Target(upstream.REMOTE_PUT, ledger.on_peer_put),
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
    if connector is not None and hasattr(connector, upstream.TO_DEVICE.name):
        wrap(type(connector), upstream.TO_DEVICE.name, worker.on_to_device)
    return worker.on_retrieve(wrapped, instance, args, kwargs)


_RETRIEVE = Target(upstream.ENGINE_RETRIEVE, _on_retrieve)

# The KV connector interface (KVConnectorBase_V1) both model runners call, by role. Wrapped on
# the class of whatever connector vLLM creates (LMCacheConnectorV1, MultiConnector, ...), so
# kvscope needs no change to the user's --kv-transfer-config.
SCHEDULER_HOOKS = {upstream.CONNECTOR_LOOKUP.name: scheduler.on_lookup}
WORKER_HOOKS = {upstream.CONNECTOR_BIND.name: worker.on_bind,
                upstream.CONNECTOR_START_LOAD.name: worker.on_start_load_kv,
                upstream.CONNECTOR_FINISH_FORWARD.name: worker.on_forward_done,
                upstream.CONNECTOR_WAIT_FOR_SAVE.name: worker.on_forward_done}


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


_CONNECTOR = Target(upstream.CONNECTOR_FACTORY, _on_create_connector)
_OWN = (_RETRIEVE, _CONNECTOR)  # targets whose wrappers live here


def _apply(module: ModuleType) -> None:
    if not _state["active"]:
        return
    for target in (*TARGETS, *_OWN):
        surface = target.surface
        if surface.module == module.__name__:
            owner = getattr(module, surface.owner, None)
            if owner is None or not hasattr(owner, surface.name):
                logger.warning("kvscope tracer: %s.%s not found; its span is missing",
                               surface.module, surface.path)
                continue
            wrap(owner, surface.name, target.wrapper)
    if module.__name__ == pipeline.DISK_HOOKS:
        module.add_listener(_listener)
        module.add_listener(_ledger_listener)


class KvscopeInstrumentor(BaseInstrumentor):
    """Spans for queue, KV lookup, KV load (reads, transfers), prefill, store, first token."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        _state["active"] = True
        modules = {t.surface.module for t in (*TARGETS, *_OWN)} | {pipeline.DISK_HOOKS}
        for name in sorted(modules):
            if name in sys.modules:
                _apply(sys.modules[name])
            if name not in _hooked:
                _hooked.add(name)
                wrapt.register_post_import_hook(_apply, name)
        transfer = sys.modules.get(upstream.TRANSFER_GROUP.module)
        if transfer is not None and upstream.HAS_TRANSFER_GROUP.resolve()():
            instrument_connector(upstream.TRANSFER_GROUP.resolve()())  # made before instrument()

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
