"""Drives vLLM's own model-runner KV-connector glue (V1 and V2) around a timed forward, with
kvscope's tracing plugin on, and prints what the connector saw. Run by test_runner_hooks.py in
a fresh interpreter (the plugin instruments at start-up, as in a vLLM process)."""

from __future__ import annotations

import json
import sys
import time

import kvscope.tracer.vllm_plugin as plugin

plugin.register()  # what vLLM does with its general plugins, first thing in each process

from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import (  # noqa: E402
    KVConnectorModelRunnerMixin,
)

from standin_connector import RecordingConnector, StepMetadata  # noqa: E402
from kvscope.tracer.scheduler import PAYLOAD_ATTR  # noqa: E402

FORWARD_S = 0.05
PREFILL_TOKENS = {"load-then-prefill": 512, "prefill-only": 256, "decode": 0}


def step_output(step: int, runner: str, sync_loads: bool) -> SchedulerOutput:
    """A step's SchedulerOutput carrying kvscope's payload, as the engine core would send it."""
    output = SchedulerOutput.make_empty()
    output.has_sync_kv_loads = sync_loads
    metadata = StepMetadata()
    requests = {}
    for n, (name, tokens) in enumerate(PREFILL_TOKENS.items()):
        trace_id = f"{step:02x}{n:02x}" + "ab" * 14
        requests[f"{runner}-{step}-{name}"] = {"h": {"traceparent": f"00-{trace_id}-{'cd' * 8}-01"},
                                              "p": tokens}
    setattr(metadata, PAYLOAD_ATTR, {"requests": requests, "sync_loads": sync_loads})
    output.kv_connector_metadata = metadata
    return output


def forward(windows: list, runner: str, step: int) -> None:
    started = time.monotonic_ns()
    time.sleep(FORWARD_S)
    windows.append({"runner": runner, "step": step, "start": started, "end": time.monotonic_ns()})


def main() -> None:
    config = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="RecordingConnector", kv_role="kv_both",
        kv_connector_module_path="standin_connector"))
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, None)
    kv_transfer_state._KV_CONNECTOR_AGENT = connector  # what ensure_kv_transfer_initialized does
    windows: list[dict] = []

    v2 = ActiveKVConnector(config, {})
    for step, sync_loads in enumerate((True, False)):
        output = step_output(step, "v2", sync_loads)
        v2.pre_forward(output)
        forward(windows, "v2", step)
        v2.finish_forward()
        v2.post_forward(set())

    for step, sync_loads in enumerate((True, False)):
        output = step_output(step, "v1", sync_loads)
        with set_forward_context(None, config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(output):
            forward(windows, "v1", step)

    json.dump({"calls": RecordingConnector.calls, "forwards": windows}, sys.stdout)


if __name__ == "__main__":
    main()
