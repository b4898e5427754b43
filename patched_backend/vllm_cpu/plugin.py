"""vLLM general plugin (entry point `vllm.general_plugins`): gives LMCache a KV connector on CPU,
and bf16 linear layers an fp32 GEMM where oneDNN has no bf16 one (fp32_gemm.py, opt-in by env).

vLLM runs general plugins in every one of its processes. Importing LMCache's connector module
early breaks vLLM's engine start, so `register()` only arms a post-import hook; the factory is
wrapped when LMCache itself imports it, inside the worker that builds the connector. The wrapper
asks LMCache first and steps in only when LMCache has no connector for this device, so on CUDA
nothing changes.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

import wrapt

logger = logging.getLogger(__name__)
_FACTORY_MODULE = "lmcache.v1.gpu_connector"


def register() -> None:
    from kvscope.patched_backend.vllm_cpu import fp32_gemm

    wrapt.register_post_import_hook(_wrap_connector_factory, _FACTORY_MODULE)
    fp32_gemm.register()
    from kvscope.tracer.vllm_plugin import warn_if_not_loaded  # imports nothing else

    warn_if_not_loaded()


def _wrap_connector_factory(module: ModuleType) -> None:
    original = module.CreateGPUConnector
    if getattr(original, "__kvscope_wrapped__", False):
        return

    @functools.wraps(original)
    def create(config: Any, metadata: Any, engine: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(config, metadata, engine, *args, **kwargs)
        except RuntimeError:
            if not _lmcache_lacks_vllm_connector(engine):
                raise
        from kvscope.patched_backend.vllm_cpu.connector import CPUPagedKVConnector

        logger.info("LMCache has no vLLM connector for CPU; using kvscope's CPU KV connector")
        return CPUPagedKVConnector.from_metadata(metadata)

    create.__kvscope_wrapped__ = True  # type: ignore[attr-defined]
    module.CreateGPUConnector = create


def _lmcache_lacks_vllm_connector(engine: Any) -> bool:
    from lmcache import torch_device_type
    from lmcache.utils import EngineType

    return engine == EngineType.VLLM and torch_device_type == "cpu"
