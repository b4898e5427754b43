"""What became of each looked-up chunk: which tier served it, or why it missed (the chunk ledger).

The tracer's worker keeps the ledger (kvscope.tracer.ledger) and writes it on the
SPAN_KV_LEDGER span of each lookup (semconv LEDGER_* keys, one array element per chunk);
analysis turns those spans into the chunk_ledger table (rundir.CHUNK_LEDGER) and the
attribution's per-tier / per-reason token columns named here. docs/run-directory.md says what
each value means.
"""

from __future__ import annotations

# Tiers that serve a chunk, in the order a lookup asks them. TIER_NONE: nobody served it.
TIER_VLLM = "vllm"  # vLLM's own prefix cache (the scheduler's num_computed_tokens)
TIER_CPU = "cpu"  # LMCache's LocalCPUBackend (local_cpu: true)
TIER_DISK = "disk"  # a disk tier: the kvscope plugin or LMCache's LocalDiskBackend
TIER_OTHER = "other"  # any other LMCache backend (P2P, remote, ...); `detail` names it
TIER_NONE = "none"
TIERS = (TIER_VLLM, TIER_CPU, TIER_DISK, TIER_OTHER)

# Why a chunk missed (its tier is TIER_NONE), most specific fact first.
NEVER_STORED = "never_stored"  # no store of this key seen by this server
PARTIAL_CHUNK = "partial_chunk"  # the last, shorter chunk, never stored (save_unfull_chunk on)
STORE_QUEUED = "store_queued"  # stored, its disk write still queued or running
STORE_QUEUE_FULL = "store_queue_full"  # disk write dropped: the write queue was full
STORE_NO_SPACE = "store_no_space"  # disk write skipped: no evictable space within capacity
STORE_ENOSPC = "store_enospc"  # disk write failed: ENOSPC
STORE_ERROR = "store_error"  # disk write failed otherwise (`detail` says how)
EVICTED_DISK = "evicted_disk"  # evicted from the disk tier by its capacity (`detail`)
EVICTED_CPU = "evicted_cpu"  # evicted from LMCache's CPU tier and no disk copy
REFUSED = "refused"  # the disk tier refused the file (`detail`: the backend's reason)
DIVERGED = "diverged"  # the prefix diverged at token `diverged_at` (a stored sibling differs)
BEHIND_MISS = "behind_miss"  # present, but after a missed chunk (LMCache uses a prefix only)
LOAD_FAILED = "load_failed"  # the lookup hit, the load did not serve it (no refusal seen)
REASONS = (
    NEVER_STORED, PARTIAL_CHUNK, STORE_QUEUED, STORE_QUEUE_FULL, STORE_NO_SPACE, STORE_ENOSPC,
    STORE_ERROR, EVICTED_DISK, EVICTED_CPU, REFUSED, DIVERGED, BEHIND_MISS, LOAD_FAILED,
)

# StoreEvent.reason values of the kvscope disk backend (patched_backend hooks) -> miss reason
STORE_FAILURE_REASON = {
    "queue_full": STORE_QUEUE_FULL, "no_space": STORE_NO_SPACE, "ENOSPC": STORE_ENOSPC,
}


def hit_tokens_column(tier: str) -> str:
    """The attribution column of the tokens a tier served."""
    return f"hit_tokens_{tier}"


def missed_tokens_column(reason: str) -> str:
    """The attribution column of the tokens that missed for `reason`."""
    return f"missed_tokens_{reason}"


TOKEN_COLUMNS = (
    "ledger_chunks", "ledger_tokens",
    *(hit_tokens_column(t) for t in TIERS), *(missed_tokens_column(r) for r in REASONS),
)
