# SPDX-License-Identifier: Apache-2.0
"""vLLM general plugin (entry point `vllm.general_plugins`): tracing, only when asked for.

vLLM runs general plugins in each of its processes. With `KVSCOPE_TRACING=1` in the server's
environment this instruments that process; otherwise it returns without importing anything.
"""

from __future__ import annotations

import os

ENV_TRACING = "KVSCOPE_TRACING"


def enabled(env: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    return (os.environ if env is None else env).get(ENV_TRACING, "0") == "1"


def register() -> None:
    if not enabled():
        return
    from tracer.instrumentor import KvscopeInstrumentor

    KvscopeInstrumentor().instrument()
