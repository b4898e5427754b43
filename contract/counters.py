"""The kvscope disk backend's counter names: what it counts, what the manifest and /metrics show.

The backend (patched_backend.parallel_disk.stats) counts them; the driver sums them into
manifest.disk_backend and the tracer exports them as kvscope_disk_backend_<name>_total, so
all three take the names from here.
"""

DISK_BACKEND_COUNTERS = (
    "lookup_hits", "lookup_misses",
    "read_hits", "read_misses", "read_bytes", "read_batches",
    "stores", "store_bytes", "store_failures", "stores_skipped",
    "evictions", "evicted_bytes", "corrupt_chunks",
    # prefetch_on_lookup: chunks read ahead, claimed by a get, released unclaimed
    "prefetch_reads", "prefetch_claimed", "prefetch_unclaimed",
    # stores not queued because the write queue was full (its memory bound)
    "stores_dropped",
)
CORRUPT_BY_REASON = "corrupt_by_reason"  # refused chunk files per reason (sums to corrupt_chunks)
MISS_BY_REASON = "miss_by_reason"  # reads that missed with the file left indexed, per reason
# The read knobs a serving backend runs with (set, or chosen by `kvscope.tune: auto`): in its
# stats and in manifest.disk_backend.read_knobs, so a study shows what each run read with.
READ_KNOBS = ("mode", "read_unit", "queue_depth", "max_inflight_bytes", "tune",
              "pipeline_transfer")
READ_KNOBS_KEY = "read_knobs"
