# SPDX-License-Identifier: Apache-2.0
"""vLLM general plugin (entry point `vllm.general_plugins`): tracing, only when asked for.

vLLM runs general plugins in each of its processes. With `KVSCOPE_TRACING=1` in the server's
environment this validates the tracer's configuration (one warning per bad value), says in one
line per process whether tracing is on, where spans go and with which sampler (and why nothing
will be exported, if so), and instruments that process. Otherwise it returns without importing
anything. It never raises into vLLM.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from kvscope.contract.env import ENV_SPANS_DIR, ENV_TRACING, TRACING_PLUGIN

logger = logging.getLogger(__name__)


def enabled(env: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    return (os.environ if env is None else env).get(ENV_TRACING, "0") == "1"


def register() -> None:
    value = os.environ.get(ENV_TRACING, "0").strip()
    if value == "0":
        return
    _say_to_stderr_unless_configured()
    if value != "1":
        logger.warning("kvscope tracing: off in pid %d: %s=%r is neither 1 nor 0; set %s=1 to "
                       "trace", os.getpid(), ENV_TRACING, value, ENV_TRACING)
        return
    from kvscope.tracer import failsafe

    try:
        _start()
    except Exception as e:  # vLLM goes on without kvscope's tracing
        failsafe.count("vllm_plugin.register", e,
                       fix="tracing is off in this process; vLLM serves as if kvscope were not "
                       "installed")


def _start() -> None:
    from kvscope.tracer import config, exporter_link, metrics
    from kvscope.tracer.instrumentor import KvscopeInstrumentor

    cfg = config.load()
    where = cfg.destinations()
    process = f"pid {os.getpid()} ({multiprocessing.current_process().name})"
    if where:
        logger.info("kvscope tracing: on in %s; spans to %s; sampler %s", process,
                    " and ".join(where), cfg.sampler_text())
    else:
        logger.warning("kvscope tracing: on in %s but nothing will be exported: neither %s nor "
                       "OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT is set (or they were refused "
                       "above); sampler %s", process, ENV_SPANS_DIR, cfg.sampler_text())
    KvscopeInstrumentor().instrument()
    metrics.start_in_this_process()
    # before vLLM starts its other processes, which inherit it (after the metrics directory,
    # which the exporter process inherits too)
    exporter_link.start_if_first()


def _say_to_stderr_unless_configured() -> None:
    """vLLM configures its own logger only after plugins ran, and never the root logger: unless
    the application set up logging, the tracer's lines go to stderr (the server's log)."""
    package = logging.getLogger(__name__.rpartition(".")[0])  # kvscope.tracer
    if not package.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)


def warn_if_not_loaded() -> None:
    """For kvscope's other plugin: KVSCOPE_TRACING=1 but VLLM_PLUGINS leaves this one out."""
    plugins = os.environ.get("VLLM_PLUGINS")
    if enabled() and plugins is not None and TRACING_PLUGIN not in plugins.split(","):
        _say_to_stderr_unless_configured()
        logger.warning("kvscope tracing: off in pid %d: %s=1 but VLLM_PLUGINS=%r does not name "
                       "%s, so vLLM does not load it; add %s to VLLM_PLUGINS", os.getpid(),
                       ENV_TRACING, plugins, TRACING_PLUGIN, TRACING_PLUGIN)
