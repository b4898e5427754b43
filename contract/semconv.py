"""Span names and attribute keys: defined once, shared by the tracer (writes) and every reader.

`gen_ai.*` keys are the ones vLLM and the GenAI semantic conventions already use; everything of
our own lives under `kvscope.`, lower_snake, with the unit in the name. ATTRIBUTE_TYPES says
what type of value each key carries: backends that store spans in a form of their own (Jaeger
keeps an array as its JSON text) give it back otherwise, and contract.otlp_json restores it.
Spans are stored as OTLP JSON in RUN/spans/ (rundir.SPANS_DIR, format contract.otlp_json);
readers turn them into one frame of SPAN_COLUMNS, through the span table analysis writes as
spans.parquet.
"""

from __future__ import annotations

from dataclasses import dataclass

# Span names, from the client's request down to the device read.
SPAN_CLIENT_REQUEST = "kvscope.client.request"  # root: client send -> last token (client clock)
SPAN_SERVER_REQUEST = "kvscope.server.request"  # API server: add_request -> finished (root if
# the caller sent no traceparent); event EVENT_FIRST_TOKEN when the first token came out
SPAN_QUEUE = "kvscope.queue"  # arrival in vLLM -> first scheduled
SPAN_KV_LOOKUP = "kvscope.kv.lookup"  # scheduler asks LMCache how many tokens it holds
SPAN_KV_LOAD = "kvscope.kv.load"  # worker loads the hit tokens (parent of reads and transfers)
SPAN_STORAGE_READ = "kvscope.storage.read"  # one batch of chunk reads from the storage tier
SPAN_KV_TRANSFER = "kvscope.kv.transfer"  # copy into the paged KV cache (H2D on CUDA)
SPAN_PREFILL = "kvscope.prefill"  # the forward pass over this request's uncached tokens
SPAN_KV_STORE = "kvscope.kv.store"  # saving new KV to LMCache after the forward
SPAN_KV_LEDGER = "kvscope.kv.ledger"  # worker: LMCache's lookup of one request, chunk by chunk
SPAN_FIRST_TOKEN = "kvscope.first_token"  # zero-length marker at the first streamed token
EVENT_FIRST_TOKEN = "kvscope.first_token"  # span event on the server request span

# Attribute keys shared with vLLM / GenAI semantic conventions.
GEN_AI_REQUEST_ID = "gen_ai.request.id"
GEN_AI_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
GEN_AI_TTFT = "gen_ai.latency.time_to_first_token"
GEN_AI_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"  # vLLM's own: scheduled_ts - queued_ts
GEN_AI_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
ERROR_TYPE = "error.type"

# Our own attribute keys.
REQUEST_ID = "kvscope.request_id"  # the client's id (X-Request-Id), on every span
VLLM_REQUEST_ID = "kvscope.vllm.request_id"  # vLLM's internal id (client id + random suffix)
PHASE = "kvscope.phase"
PROMPT_INDEX = "kvscope.prompt_index"
CONCURRENCY = "kvscope.concurrency"  # requests the client allowed in flight
CACHED_TOKENS = "kvscope.kv.cached_tokens"
HIT_TOKENS = "kvscope.kv.hit_tokens"
READ_BYTES = "kvscope.storage.read_bytes"
READ_CHUNKS = "kvscope.storage.chunks"
READ_SUBREADS = "kvscope.storage.subreads"
READ_BACKEND = "kvscope.storage.backend"
READ_DEVICE = "kvscope.storage.device"
READ_INFLIGHT_AT_SUBMIT = "kvscope.storage.inflight_at_submit"
READER_TIDS = "kvscope.storage.reader_tids"  # threads that issued the reads (joins block I/O)
READ_FAILED_CHUNKS = "kvscope.storage.failed_chunks"  # chunks refused (served as misses)
READ_AHEAD = "kvscope.storage.read_ahead"  # true: started at lookup, before this request's load
# Where each chunk of a storage.read lies on disk and when it was read: block reads are joined
# to the chunk whose sectors they read (analysis.blockjoin), whatever thread or I/O engine
# issued them. Per-chunk arrays are parallel (index = chunk); extents point into them.
READ_CHUNK_KEY = "kvscope.storage.chunk.key"  # [str] chunk key, one per chunk read
READ_CHUNK_SUBMIT_NS = "kvscope.storage.chunk.submit_ns"  # [int] monotonic ns its reads queued
READ_CHUNK_READY_NS = "kvscope.storage.chunk.ready_ns"  # [int] its last read done, -1: not done
READ_EXTENT_CHUNK = "kvscope.storage.extent.chunk"  # [int] index of the chunk this extent is of
READ_EXTENT_START = "kvscope.storage.extent.start_sector"  # [int] first whole-disk 512 B sector
READ_EXTENT_END = "kvscope.storage.extent.end_sector"  # [int] one past its last sector
TRANSFER_BYTES = "kvscope.transfer.bytes"
TRANSFER_KIND = "kvscope.transfer.kind"  # "cpu_copy" here, "h2d" on CUDA
PREFILL_TOKENS = "kvscope.prefill.tokens"
VLLM_CACHED_TOKENS = "kvscope.kv.vllm_cached_tokens"  # on kv.lookup: vLLM's own prefix hits

# The chunk ledger (contract.chunk_outcomes), on SPAN_KV_LEDGER: one array element per looked-up chunk.
LEDGER_START = "kvscope.ledger.start_token"  # [int] first token of each chunk
LEDGER_END = "kvscope.ledger.end_token"  # [int] one past its last token
LEDGER_KEY = "kvscope.ledger.chunk_hash"  # [str] LMCache chunk hash (hex)
LEDGER_TIER = "kvscope.ledger.tier"  # [str] contract.chunk_outcomes tier, "none" for a miss
LEDGER_REASON = "kvscope.ledger.reason"  # [str] contract.chunk_outcomes reason, "" for a hit
LEDGER_DETAIL = "kvscope.ledger.detail"  # [str] backend name, capacity, refusal reason, error
LEDGER_FACT_NS = "kvscope.ledger.fact_ns"  # [int] monotonic ns of the fact (eviction...), -1
LEDGER_STORED_NS = "kvscope.ledger.stored_ns"  # [int] when the chunk was stored, -1
LEDGER_DIVERGED_AT = "kvscope.ledger.diverged_at"  # [int] token where the prefix diverged, -1
LEDGER_DROPPED = "kvscope.ledger.dropped"  # ledger records this process dropped so far (bound)

# The resource keys (OpenTelemetry's) that name the process a span came from.
SERVICE_NAME = "service.name"
PROCESS_PID = "process.pid"


@dataclass(frozen=True)
class ValueType:
    """An attribute's value type: a scalar (str, int, float, bool) or an array of one."""

    scalar: type
    array: bool = False

    def holds(self, value: object) -> bool:
        """`value` (a plain value: a list for an array) is of this type already, with no
        conversion (a bool is no int here, as in contract.otlp_json)."""
        if not self.array:
            return type(value) is self.scalar
        return type(value) is list and all(type(v) is self.scalar for v in value)


STRING, INT, DOUBLE, BOOL = ValueType(str), ValueType(int), ValueType(float), ValueType(bool)
STRING_ARRAY, INT_ARRAY = ValueType(str, array=True), ValueType(int, array=True)

# The type of every key above, as the tracer writes it.
ATTRIBUTE_TYPES: dict[str, ValueType] = {
    GEN_AI_REQUEST_ID: STRING, GEN_AI_PROMPT_TOKENS: INT, GEN_AI_TTFT: DOUBLE,
    GEN_AI_TIME_IN_QUEUE: DOUBLE, GEN_AI_COMPLETION_TOKENS: INT, ERROR_TYPE: STRING,
    REQUEST_ID: STRING, VLLM_REQUEST_ID: STRING, PHASE: STRING, PROMPT_INDEX: INT,
    CONCURRENCY: INT, CACHED_TOKENS: INT, HIT_TOKENS: INT, READ_BYTES: INT, READ_CHUNKS: INT,
    READ_SUBREADS: INT, READ_BACKEND: STRING, READ_DEVICE: STRING, READ_INFLIGHT_AT_SUBMIT: INT,
    READER_TIDS: INT_ARRAY, READ_FAILED_CHUNKS: INT, READ_AHEAD: BOOL, TRANSFER_BYTES: INT,
    TRANSFER_KIND: STRING, PREFILL_TOKENS: INT, VLLM_CACHED_TOKENS: INT,
    LEDGER_START: INT_ARRAY, LEDGER_END: INT_ARRAY, LEDGER_KEY: STRING_ARRAY,
    LEDGER_TIER: STRING_ARRAY, LEDGER_REASON: STRING_ARRAY, LEDGER_DETAIL: STRING_ARRAY,
    LEDGER_FACT_NS: INT_ARRAY, LEDGER_STORED_NS: INT_ARRAY, LEDGER_DIVERGED_AT: INT_ARRAY,
    LEDGER_DROPPED: INT,
    READ_CHUNK_KEY: STRING_ARRAY, READ_CHUNK_SUBMIT_NS: INT_ARRAY, READ_CHUNK_READY_NS: INT_ARRAY,
    READ_EXTENT_CHUNK: INT_ARRAY, READ_EXTENT_START: INT_ARRAY, READ_EXTENT_END: INT_ARRAY,
    SERVICE_NAME: STRING, PROCESS_PID: INT,
}

# The columns of a run's spans as readers hold them: times are the run's monotonic ns,
# `attributes` a dict, `service` / `pid` the emitting process's resource (`pid` NO_PID when
# it has none). spans.parquet stores them as contract.spantable.SCHEMA.
SPAN_COLUMNS = (
    "trace_id", "span_id", "parent_span_id", "name", "start_ns", "end_ns", "request_id",
    "attributes", "service", "pid",
)
NO_PID = -1
