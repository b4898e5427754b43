# SPDX-License-Identifier: Apache-2.0
"""Issue 14 item 9: every chunk read belongs to exactly one request's storage-read spans.

Reads ahead at lookup that wait in the backlog are started later on whichever thread frees
budget: a get claiming its own reads (``take``) or a release. That thread is inside another
request's kv.load, yet the read is not that request's: it is the request's that claims it.
16 requests at once with a backlog: the real tracer listener (tracer/storage.py) and the real
OpenTelemetry SDK; spans go to an in-memory exporter instead of OTLP (runtime.get replaced).
"""

# Standard
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
import random

# Third Party
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
import pytest

# First Party
from kvscope.testkit.lmcache_harness import assert_exact
from kvscope.patched_backend.parallel_disk import hooks
from test_backend_prefetch import CHUNK_BYTES, lookup, settled, unpin, wait_for
from kvscope.tracer import runtime
from kvscope.contract import semconv
from kvscope.tracer.spans import RequestTrace
from kvscope.tracer.storage import ParallelReadListener
from kvscope.tracer.worker import current

REQUESTS, PER_REQUEST = 16, 2


@pytest.fixture
def exported(monkeypatch):
    """Finished spans of this process's tracer, in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    built = runtime.Runtime(SimpleNamespace(provider=provider, span_processor=processor), 0)
    monkeypatch.setattr(runtime, "get", lambda *a, **k: built)
    listener = ParallelReadListener()
    hooks.add_listener(listener)
    yield exporter
    hooks.remove_listener(listener)


def _request(i: int) -> RequestTrace:
    context = trace.SpanContext(trace_id=0x1000 + i, span_id=0x2000 + i, is_remote=True,
                                trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    parent = trace.set_span_in_context(trace.NonRecordingSpan(context))
    return RequestTrace(parent, f"req-{i}", f"cmpl-req-{i}-0-abcd")


@pytest.mark.timeout(300)
def test_16_concurrent_requests_with_a_read_ahead_backlog_each_get_exactly_their_reads(
        harness, exported):
    h = harness(**{"kvscope.prefetch_bytes": 4 * CHUNK_BYTES, "kvscope.read_unit": "64KiB",
                   "kvscope.queue_depth": 8})
    wanted = {i: [PER_REQUEST * i + j for j in range(PER_REQUEST)] for i in range(REQUESTS)}
    h.put([c for chunks in wanted.values() for c in chunks])
    for i in range(REQUESTS):  # the scheduler looks every request up first: a backlog forms
        assert lookup(h, wanted[i]) == PER_REQUEST
    assert h.backend.stats()["prefetch_pending"] == REQUESTS * PER_REQUEST
    order = list(range(REQUESTS))
    random.Random(14).shuffle(order)

    def load(i: int) -> None:
        request = _request(i)
        marker = current.set(request)  # what tracer/worker.py sets around the retrieve
        try:
            with hooks.request_context(request.vllm_request_id):
                assert_exact(h.get(wanted[i]), wanted[i])
        finally:
            current.reset(marker)
        unpin(h, wanted[i])

    with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
        list(pool.map(load, order))
    wait_for(lambda: settled(h))
    stats = h.backend.stats()
    assert stats["prefetch_claimed"] > 0  # reads ahead were claimed (the backlog case)
    chunks: dict[str, int] = {}
    for span in exported.get_finished_spans():
        if span.name == semconv.SPAN_STORAGE_READ:
            who = span.attributes[semconv.REQUEST_ID]
            chunks[who] = chunks.get(who, 0) + span.attributes[semconv.READ_CHUNKS]
    assert chunks == {f"req-{i}": PER_REQUEST for i in range(REQUESTS)}, (chunks, stats)
