"""bf16 linear layers in fp32 where oneDNN has no bf16 matmul: same products, bf16 out."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from kvscope.contract.env import ENV_FP32_GEMM
from kvscope.patched_backend.vllm_cpu import fp32_gemm


@pytest.fixture(autouse=True)
def _armed(monkeypatch):
    """The server asked for fp32 GEMMs (the post-import hook is called by hand here)."""
    monkeypatch.setenv(ENV_FP32_GEMM, "1")
    monkeypatch.setattr(fp32_gemm.wrapt, "register_post_import_hook", lambda hook, name: None)
    fp32_gemm.register()
    yield
    fp32_gemm.unregister()


def _dispatch_module() -> tuple[ModuleType, list]:
    """A stand-in for vllm.model_executor.layers.utils whose dispatch records its calls."""
    calls: list = []
    module = ModuleType("standin")
    module.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: calls.append(layer)
    fp32_gemm._wrap_dispatch(module)
    return module, calls


def _layer(dtype: torch.dtype, n: int = 96, k: int = 64) -> SimpleNamespace:
    return SimpleNamespace(weight=torch.nn.Parameter(torch.randn(n, k).to(dtype),
                                                     requires_grad=False))


def test_bf16_layers_get_an_fp32_gemm_rounded_to_bf16(monkeypatch):
    monkeypatch.setattr(fp32_gemm, "onednn_lacks_bf16", lambda: True)
    module, calls = _dispatch_module()
    layer = _layer(torch.bfloat16)
    weight = layer.weight.detach().clone()
    module.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert calls == [] and layer.weight.numel() == 0  # vLLM's bf16 fallback never ran
    x, bias = torch.randn(33, 64).bfloat16(), torch.randn(96).bfloat16()
    out = layer.cpu_linear(x, layer.weight, bias)
    exact = (x.double() @ weight.double().t() + bias.double()).bfloat16()
    assert out.dtype == torch.bfloat16 and out.shape == (33, 96)
    # fp32 accumulation: at most one bf16 rounding step away from the exact result
    ulp = exact.float().abs().clamp(min=1e-3) * 2 ** -7
    assert ((out.float() - exact.float()).abs() <= ulp).all()
    assert layer.cpu_linear(x[:1], layer.weight, None).shape == (1, 96)


def test_other_layers_and_bf16_capable_cpus_keep_vllms_path(monkeypatch):
    monkeypatch.setattr(fp32_gemm, "onednn_lacks_bf16", lambda: True)
    module, calls = _dispatch_module()
    fp32 = _layer(torch.float32)
    module.dispatch_cpu_unquantized_gemm(fp32, remove_weight=True)
    assert calls == [fp32]
    monkeypatch.setattr(fp32_gemm, "onednn_lacks_bf16", lambda: False)
    bf16 = _layer(torch.bfloat16)
    module.dispatch_cpu_unquantized_gemm(bf16, remove_weight=True)
    assert calls == [fp32, bf16]


def test_the_hook_is_armed_only_when_the_server_asks(monkeypatch):
    armed: list = []
    monkeypatch.setattr(fp32_gemm.wrapt, "register_post_import_hook",
                        lambda hook, name: armed.append(name))
    fp32_gemm.unregister()
    monkeypatch.delenv(ENV_FP32_GEMM, raising=False)
    fp32_gemm.register()
    assert armed == []
    monkeypatch.setenv(ENV_FP32_GEMM, "1")
    fp32_gemm.register()
    assert armed == ["vllm.model_executor.layers.utils"]


def test_wrapping_twice_keeps_one_wrapper():
    module, _ = _dispatch_module()
    once = module.dispatch_cpu_unquantized_gemm
    fp32_gemm._wrap_dispatch(module)
    assert module.dispatch_cpu_unquantized_gemm is once



def test_unregister_gives_vllm_its_dispatch_back(monkeypatch):
    module, calls = _dispatch_module()
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.utils", module)
    fp32_gemm.unregister()
    layer = _layer(torch.bfloat16)
    module.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert calls == [layer]
    fp32_gemm._wrap_dispatch(module)  # a hook firing after unregister wraps nothing
    assert not isinstance(module.dispatch_cpu_unquantized_gemm, fp32_gemm.wrapt.ObjectProxy)
