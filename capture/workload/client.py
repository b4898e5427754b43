"""Streaming OpenAI-completions client: N requests at concurrency C, client-side TTFT each.

Every request carries an `X-Request-Id` (so vLLM's request id starts with ours) and, when
tracing is on, the W3C `traceparent` of its own `kvscope.client.request` span (so the server's
spans join the client's trace).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import aiohttp


@dataclass
class RequestRecord:
    """One row of requests.parquet (see docs/run-directory.md)."""

    request_id: str
    phase: str
    concurrency: int
    prompt_index: int
    trace_id: str
    prompt_tokens: int = -1
    cached_tokens: int = -1
    output_tokens: int = 0
    arrival_ns: int = -1
    first_token_ns: int = -1
    finish_ns: int = -1
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    status: str = "error"
    error: str = ""

    def as_row(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RequestPlan:
    base_url: str
    model: str
    max_tokens: int
    timeout_s: float = 600.0
    tracer: Any = None  # a tracer.client.ClientTracer, or None when tracing is off


async def _send(
    session: aiohttp.ClientSession, plan: RequestPlan, prompt: list[int], record: RequestRecord
) -> None:
    body = {
        "model": plan.model, "prompt": prompt, "max_tokens": plan.max_tokens,
        "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
    }
    headers = {"X-Request-Id": record.request_id}
    record.arrival_ns = time.monotonic_ns()
    span = None
    if plan.tracer is not None:
        span, trace_headers = plan.tracer.start(record)
        headers.update(trace_headers)
    try:
        async with session.post(f"{plan.base_url}/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                record.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return
            async for raw in r.content:
                _consume_event(raw, record)
        record.status = "ok" if record.first_token_ns > 0 else "error"
        if record.status == "error":
            record.error = "stream ended without a token"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        record.error = f"{type(e).__name__}: {e}"
    finally:
        record.finish_ns = time.monotonic_ns()
        record.e2e_s = (record.finish_ns - record.arrival_ns) / 1e9
        if record.first_token_ns > 0:
            record.ttft_s = (record.first_token_ns - record.arrival_ns) / 1e9
        if span is not None:
            plan.tracer.end(span, record)


def _consume_event(raw: bytes, record: RequestRecord) -> None:
    """Handle one server-sent-event line: first token time, token count, usage."""
    line = raw.decode().strip()
    if not line.startswith("data:") or line == "data: [DONE]":
        return
    event = json.loads(line[len("data:"):])
    for choice in event.get("choices") or ():
        if choice.get("text") is not None and record.first_token_ns < 0:
            record.first_token_ns = time.monotonic_ns()
        record.output_tokens += 1 if choice.get("text") is not None else 0
    usage = event.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens", -1)
        record.output_tokens = usage.get("completion_tokens", record.output_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            record.cached_tokens = details["cached_tokens"]


async def run_requests(
    plan: RequestPlan, prompts: list[list[int]], records: list[RequestRecord], concurrency: int,
    on_done: Callable[[RequestRecord], object] = lambda r: None,
) -> None:
    """Send prompts[i] for records[i], at most `concurrency` in flight."""
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=plan.timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(prompt: list[int], record: RequestRecord) -> None:
            async with limit:
                await _send(session, plan, prompt, record)
                on_done(record)

        await asyncio.gather(*(one(p, r) for p, r in zip(prompts, records, strict=True)))
