"""A KV connector standing in for LMCache (which needs a running vLLM engine) in the runner
tests: it records when vLLM's model-runner glue calls each interface method, and takes a
known time in the calls that do work."""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

LOAD_S = 0.03
SAVE_S = 0.02


class StepMetadata(KVConnectorMetadata):
    """What the scheduler side would send: kvscope's payload rides on it as an attribute."""


class RecordingConnector(KVConnectorBase_V1):
    """Every interface call as (method, start monotonic ns, end monotonic ns)."""

    calls: list[tuple[str, int, int]] = []

    def _record(self, method: str, started: int, work_s: float = 0.0) -> None:
        if work_s:
            time.sleep(work_s)
        RecordingConnector.calls.append((method, started, time.monotonic_ns()))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        started = time.monotonic_ns()
        super().bind_connector_metadata(connector_metadata)
        self._record("bind_connector_metadata", started)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._record("start_load_kv", time.monotonic_ns(), LOAD_S)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._record("wait_for_layer_load", time.monotonic_ns())

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._record("save_kv_layer", time.monotonic_ns())

    def finish_forward(self) -> None:
        self._record("finish_forward", time.monotonic_ns())

    def wait_for_save(self) -> None:
        self._record("wait_for_save", time.monotonic_ns(), SAVE_S)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return StepMetadata()
