"""vLLM general plugin (entry point `vllm.general_plugins`): gives LMCache a KV connector on CPU,
and bf16 linear layers an fp32 GEMM where oneDNN has no bf16 one (fp32_gemm.py, opt-in by env).

vLLM runs general plugins in every one of its processes. Importing LMCache's connector module
early breaks vLLM's engine start, so `register()` only arms a post-import hook; the factory is
wrapped when LMCache itself imports it, inside the worker that builds the connector. The wrapper
asks LMCache first and steps in only when LMCache has no connector for this device. Whichever
connector it is (kvscope's on CPU, LMCache's on CUDA), it is wrapped in the pipelined transfer
(parallel_disk/pipelined_connector.py) when the kvscope disk tier is configured with
`kvscope.pipeline_transfer` (on by default in parallel mode); otherwise nothing else changes.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any, Callable

import wrapt
from opentelemetry.instrumentation.utils import unwrap

from kvscope.contract import upstream

logger = logging.getLogger(__name__)
_FACTORY = upstream.CREATE_GPU_CONNECTOR
_state = {"armed": False}


def register() -> None:
    from kvscope.patched_backend.vllm_cpu import fp32_gemm

    _state["armed"] = True
    wrapt.register_post_import_hook(_wrap_connector_factory, _FACTORY.module)
    fp32_gemm.register()
    from kvscope.tracer.vllm_plugin import warn_if_not_loaded  # imports nothing else

    warn_if_not_loaded()


def unregister() -> None:
    """Undo `register` in this process: the factory, the GEMM dispatch and the load-error
    report are vLLM's again."""
    from kvscope.patched_backend.vllm_cpu import fp32_gemm, load_errors

    _state["armed"] = False
    module = sys.modules.get(_FACTORY.module)
    if module is not None and isinstance(getattr(module, _FACTORY.name), wrapt.ObjectProxy):
        unwrap(module, _FACTORY.name)
    fp32_gemm.unregister()
    load_errors.uninstall()


def _wrap_connector_factory(module: ModuleType) -> None:
    if _state["armed"] and not isinstance(getattr(module, _FACTORY.name), wrapt.ObjectProxy):
        wrapt.wrap_function_wrapper(module, _FACTORY.name, _create_connector)


def _create_connector(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
    """LMCache's factory first; kvscope's CPU connector only where LMCache has none; either
    one inside the pipelined transfer when the kvscope tier asks for it."""
    try:
        connector = wrapped(*args, **kwargs)
    except RuntimeError:
        if not _lmcache_lacks_vllm_connector(_engine_argument(*args, **kwargs)):
            raise
        from kvscope.patched_backend.vllm_cpu.connector import CPUPagedKVConnector

        logger.info("LMCache has no vLLM connector for CPU; using kvscope's CPU KV connector")
        connector = CPUPagedKVConnector.from_metadata(_metadata_argument(*args, **kwargs))
    return _pipelined(connector, _config_argument(*args, **kwargs),
                      _metadata_argument(*args, **kwargs))


def _config_argument(config: Any, *args: Any, **kwargs: Any) -> Any:
    return config


def _engine_argument(config: Any, metadata: Any, engine: Any, *args: Any, **kwargs: Any) -> Any:
    return engine


def _metadata_argument(config: Any, metadata: Any, *args: Any, **kwargs: Any) -> Any:
    return metadata


def _lmcache_lacks_vllm_connector(engine: Any) -> bool:
    return (engine == upstream.ENGINE_TYPE.resolve().VLLM
            and upstream.DEVICE_TYPE.resolve() == "cpu")


def _pipelined(connector: Any, config: Any, metadata: Any) -> Any:
    """`connector` wrapped in the pipelined transfer when a kvscope tier asks for it and the
    engine copies got chunks only through its connector (not for MLA models: LMCache copies
    their chunks itself, lmcache_config.copies_outside_connector)."""
    from kvscope.patched_backend.parallel_disk import lmcache_config
    from kvscope.patched_backend.parallel_disk.pipelined_connector import PipelinedConnector
    from kvscope.patched_backend.vllm_cpu import load_errors

    if connector is None or not lmcache_config.pipelines_transfer(config, metadata):
        return connector
    load_errors.install()
    logger.info("kvscope: KV chunks are copied as soon as each one is read (pipeline_transfer)")
    return PipelinedConnector(connector, load_errors.report, load_errors.ready)
