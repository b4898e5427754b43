"""Fixtures for the tracer tests: real OTLP/gRPC receivers (fast and slow)."""

from __future__ import annotations

import pytest
from kvscope.testkit.tracing import start_receiver

from kvscope.tracer import config, failsafe


@pytest.fixture(autouse=True)
def _fresh_tracer_state():
    """Every tracer test starts with no counted errors and no cached configuration."""
    failsafe.reset()
    config.reset()
    yield
    failsafe.reset()
    config.reset()


@pytest.fixture
def otlp_receiver():
    """(receiver, endpoint) of a live OTLP/gRPC collector on a free port."""
    receiver, server, port = start_receiver()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def slow_otlp_receiver():
    """A collector that takes 2 s to answer each export."""
    receiver, server, port = start_receiver(delay_s=2.0)
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(grace=None)
