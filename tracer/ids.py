# SPDX-License-Identifier: Apache-2.0
"""Span and trace ids from a random stream of this process's own.

The SDK's default generator draws from Python's global `random`, which vLLM seeds with its
`--seed` (0 unless set) in each process it starts, and which tests and user code seed too. Two
processes seeded alike then draw the same ids: the worker's spans took the client's span ids in
one trace. A private stream, seeded from the OS at import and again in every forked child, is as
cheap as the default and shares its state with nobody.
"""

from __future__ import annotations

import os
import random

from opentelemetry.sdk.trace.id_generator import IdGenerator

_stream = random.Random(os.urandom(32))


def _reseed() -> None:
    _stream.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reseed)  # a forked child must not repeat its parent's ids


def span_id() -> int:
    """A random 64-bit span id, never the invalid all-zero one (the hot path's own call)."""
    return _stream.getrandbits(64) or 1


def trace_id() -> int:
    return _stream.getrandbits(128) or 1


class ProcessIdGenerator(IdGenerator):
    """Random 64-bit span and 128-bit trace ids, never the invalid all-zero id."""

    def generate_span_id(self) -> int:
        return span_id()

    def generate_trace_id(self) -> int:
        return trace_id()
