# SPDX-License-Identifier: Apache-2.0
"""The block probe's kernel side: BPF text and the pure render() that fills its placeholders.

Two keyings share one text. `rq` (best): raw tracepoints only, keyed by the `struct request *`;
dev, sector, length and op are read from the request at offsets found in the kernel's BTF, so
no header tree has to match the running kernel. `dev_sector`: classic tracepoints only, keyed by
(dev, sector), for kernels without raw tracepoints or BTF. No kprobes, no hand-written
tracepoint structs (bcc builds `args` from tracefs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Indexes of the `lost` array, also the manifest's lost_events keys.
LOST_KEYS = ("ringbuf_full", "map_full")
TWIN = b"block_rq_complete_twin"  # second completion program, attached by the probe (rq key)
BATCH = 32  # completions per ring-buffer record

# One completed request as both probes send it to userspace (EVENT_DTYPE below).
EVENT_C = """struct event_t {
    u64 start_ns; u64 insert_ns; u64 issue_ns; u64 complete_ns; u64 sector;
    u32 dev; u32 bytes; u32 tgid; u32 tid; s32 error; u32 tracked;
    char comm[16]; char rwbs[8];
};"""

BPF_TEXT = r"""
#include <uapi/linux/ptrace.h>

#define KEY_RQ KEY_RQ_VALUE
#define FILTER_PIDS FILTER_PIDS_VALUE
#define FILTER_DEVS FILTER_DEVS_VALUE

#if KEY_RQ
typedef u64 rqkey_t;
#else
typedef struct { u32 dev; u32 pad; u64 sector; } rqkey_t;
#endif

struct req_t {
    u64 start_ns; u64 insert_ns; u64 issue_ns; u64 sector;
    u32 dev; u32 bytes; u32 tgid; u32 tid; char comm[16]; char rwbs[8]; u32 tracked;
};
EVENT_STRUCT
/* Completions are batched per CPU so userspace handles one ring-buffer record per BATCH. */
struct batch_t { u32 n; u32 pad; struct event_t ev[BATCH]; };
struct hist_key_t { u32 dev; u32 slot; };

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(pending, struct batch_t, 2);   /* one per completion program (twins) */
BPF_HASH(reqs, rqkey_t, struct req_t, MAX_REQUESTS);   /* preallocated: cheaper than LRU */
BPF_HASH(pids, u32, u8, 1024);
BPF_HASH(devs, u32, u8, 64);
BPF_HISTOGRAM(queue_us, struct hist_key_t, 4096);
BPF_HISTOGRAM(service_us, struct hist_key_t, 4096);
BPF_ARRAY(lost, u64, 2);

static inline void count_lost(int index, u64 n) {
    u64 *c = lost.lookup(&index);
    if (c) lock_xadd(c, n);
}

/* Submission: the only place the task that wants the I/O is current. */
static inline void start_request(rqkey_t *key) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (FILTER_PIDS && !pids.lookup(&tgid)) return;
    struct req_t r = {};
    r.start_ns = bpf_ktime_get_ns();
    r.tgid = tgid;
    r.tid = (u32)id;
    r.tracked = 1;
    bpf_get_current_comm(&r.comm, sizeof(r.comm));
    if (reqs.update(key, &r) < 0) count_lost(1, 1);
}

static inline void insert_request(rqkey_t *key) {
    struct req_t *r = reqs.lookup(key);
    if (r) r->insert_ns = bpf_ktime_get_ns();
}

/* Issue: every request on the probed devices is followed from here, for the depth series. */
static inline void issue_request(rqkey_t *key, u32 dev, u64 sector, u32 bytes, char *rwbs) {
    if (FILTER_DEVS && !devs.lookup(&dev)) { reqs.delete(key); return; }
    u64 now = bpf_ktime_get_ns();
    struct req_t *r = reqs.lookup(key);
    if (!r) {
        struct req_t fresh = {};
        fresh.tracked = !FILTER_PIDS;
        if (reqs.update(key, &fresh) < 0) { count_lost(1, 1); return; }
        r = reqs.lookup(key);
        if (!r) return;
    }
    r->issue_ns = now;   /* a requeued request keeps its latest issue */
    r->dev = dev; r->sector = sector; r->bytes = bytes;
    __builtin_memcpy(r->rwbs, rwbs, sizeof(r->rwbs));
}

static inline void complete_request(rqkey_t *key, s32 error, u32 slot) {
    struct req_t *r = reqs.lookup(key);
    if (!r || !r->issue_ns) return;
    struct batch_t *b = pending.lookup(&slot);
    if (!b) return;
    u32 i = b->n;
    if (i >= BATCH) return;
    struct event_t *e = &b->ev[i];
    e->complete_ns = bpf_ktime_get_ns();
    e->start_ns = r->start_ns; e->insert_ns = r->insert_ns; e->issue_ns = r->issue_ns;
    e->sector = r->sector; e->dev = r->dev; e->bytes = r->bytes; e->tgid = r->tgid;
    e->tid = r->tid; e->error = error; e->tracked = r->tracked;
    __builtin_memcpy(e->comm, r->comm, sizeof(e->comm));
    __builtin_memcpy(e->rwbs, r->rwbs, sizeof(e->rwbs));
    reqs.delete(key);
    if (e->tracked) {
        struct hist_key_t h = {.dev = e->dev};
        h.slot = bpf_log2l((e->complete_ns - e->issue_ns) / 1000);
        service_us.atomic_increment(h);
        if (e->start_ns) {
            h.slot = bpf_log2l((e->issue_ns - e->start_ns) / 1000);
            queue_us.atomic_increment(h);
        }
    }
    b->n = i + 1;
    if (b->n == BATCH) {
        if (events.ringbuf_output(b, sizeof(*b), BPF_RB_NO_WAKEUP) < 0) count_lost(0, BATCH);
        b->n = 0;
    }
}

#if KEY_RQ
/* Kernel struct fields at offsets taken from the running kernel's BTF (probes/btf.py). */
static inline u64 read_u64(void *base, u32 offset) {
    u64 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (char *)base + offset);
    return v;
}

static inline u32 read_u32(void *base, u32 offset) {
    u32 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (char *)base + offset);
    return v;
}

BPF_HASH(queue_dev, u64, u32, 256);

/* Whole-disk dev_t of a request: rq->q->disk->{major, first_minor}, as block events report;
 * cached per request queue (one lookup instead of three reads through pointers). */
static inline u32 request_dev(void *rq) {
    u64 q = read_u64(rq, REQUEST_Q);
    u32 *known = queue_dev.lookup(&q);
    if (known) return *known;
    void *disk = q ? (void *)read_u64((void *)q, REQUEST_QUEUE_DISK) : 0;
    if (!disk) return 0;
    u32 dev = (read_u32(disk, GENDISK_MAJOR) << 20) | read_u32(disk, GENDISK_FIRST_MINOR);
    queue_dev.update(&q, &dev);
    return dev;
}

RAW_TRACEPOINT_PROBE(START_TRACEPOINT) {
    rqkey_t key = ctx->args[0];
    start_request(&key);
    return 0;
}

RAW_TRACEPOINT_PROBE(block_rq_insert) {
    rqkey_t key = ctx->args[0];
    insert_request(&key);
    return 0;
}

/* A request merged into another is freed without issue or completion: forget it. */
RAW_TRACEPOINT_PROBE(block_rq_merge) {
    rqkey_t key = ctx->args[0];
    reqs.delete(&key);
    return 0;
}

RAW_TRACEPOINT_PROBE(block_rq_issue) {
    void *rq = (void *)ctx->args[0];
    u32 op = read_u32(rq, REQUEST_CMD_FLAGS) & 0xff;   /* REQ_OP_MASK */
    char rwbs[8] = {};
    rwbs[0] = op == 0 ? 'R' : op == 1 ? 'W' : op == 2 ? 'F' : op == 3 ? 'D' : 'O';
    rqkey_t key = ctx->args[0];
    issue_request(&key, request_dev(rq), read_u64(rq, REQUEST___SECTOR),
                  read_u32(rq, REQUEST___DATA_LEN), rwbs);
    return 0;
}

static inline int on_complete(struct bpf_raw_tracepoint_args *ctx, u32 slot) {
    void *rq = (void *)ctx->args[0];
    if ((u32)ctx->args[2] < read_u32(rq, REQUEST___DATA_LEN))
        return 0;   /* partial completion: more to come */
    rqkey_t key = ctx->args[0];
    complete_request(&key, -(s32)(u8)ctx->args[1], slot);   /* blk_status_t, mapped later */
    return 0;
}

/* The kernel skips a raw-tracepoint program that is already running on this CPU, so a
 * completion interrupting another would be lost. Two identical programs on block_rq_complete
 * (the twin is attached from userspace) each take a request still in `reqs`: the nested call
 * runs the one not busy, and in a plain call the second finds the request already gone. */
RAW_TRACEPOINT_PROBE(block_rq_complete) {
    return on_complete(ctx, 0);
}

int block_rq_complete_twin(struct bpf_raw_tracepoint_args *ctx) {
    return on_complete(ctx, 1);
}
#else
TRACEPOINT_PROBE(block, START_TRACEPOINT) {
    rqkey_t key = {.dev = args->dev, .sector = args->sector};
    start_request(&key);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_insert) {
    rqkey_t key = {.dev = args->dev, .sector = args->sector};
    insert_request(&key);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_merge) {
    rqkey_t key = {.dev = args->dev, .sector = args->sector};
    reqs.delete(&key);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_issue) {
    rqkey_t key = {.dev = args->dev, .sector = args->sector};
    char rwbs[8] = {};
    bpf_probe_read_kernel(&rwbs, sizeof(rwbs), args->rwbs);
    issue_request(&key, args->dev, args->sector, args->bytes, rwbs);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_complete) {
    rqkey_t key = {.dev = args->dev, .sector = args->sector};
    complete_request(&key, args->error, 0);   /* already a negative errno */
    return 0;
}
#endif
"""

OFFSET_NAMES = {"REQUEST_Q", "REQUEST_CMD_FLAGS", "REQUEST___DATA_LEN", "REQUEST___SECTOR",
                "REQUEST_QUEUE_DISK", "GENDISK_MAJOR", "GENDISK_FIRST_MINOR"}

# Userspace views of struct event_t and struct batch_t (C alignment; record sizes are checked).
EVENT_DTYPE = np.dtype(
    [
        ("start_ns", "<u8"), ("insert_ns", "<u8"), ("issue_ns", "<u8"), ("complete_ns", "<u8"),
        ("sector", "<u8"), ("dev", "<u4"), ("bytes", "<u4"), ("tgid", "<u4"), ("tid", "<u4"),
        ("error", "<i4"), ("tracked", "<u4"), ("comm", "S16"), ("rwbs", "S8"),
    ],
    align=True,
)
BATCH_DTYPE = np.dtype([("n", "<u4"), ("pad", "<u4"), ("ev", EVENT_DTYPE, (BATCH,))], align=True)


@dataclass(frozen=True)
class BlockOptions:
    """What the block probe attaches to and keeps (filled by detection and the caller)."""

    key: str = "rq"  # "rq" (raw tracepoints, request pointer) or "dev_sector" (classic only)
    start_tracepoint: str = "block_io_start"  # or "block_getrq" on kernels before 6.5
    filter_pids: bool = False
    filter_devices: bool = False
    ringbuf_pages: int = 1024  # 4 MiB
    max_requests: int = 16384
    offsets: dict[str, int] = field(default_factory=dict)  # probes.btf.kernel_offsets(), rq only


def render(opts: BlockOptions) -> str:
    """The exact program loaded for `opts` (also what `kvscope probe --ebpf` prints)."""
    if opts.key not in ("rq", "dev_sector"):
        raise ValueError(f"block probe key {opts.key!r}: expected 'rq' or 'dev_sector'")
    missing = sorted(OFFSET_NAMES - set(opts.offsets)) if opts.key == "rq" else []
    if missing:
        raise ValueError(f"key 'rq' needs struct offsets {missing} (probes.btf.kernel_offsets())")
    if opts.ringbuf_pages & (opts.ringbuf_pages - 1):
        raise ValueError(f"ringbuf_pages {opts.ringbuf_pages}: must be a power of two")
    substitutions = {
        "KEY_RQ_VALUE": str(int(opts.key == "rq")),
        "FILTER_PIDS_VALUE": str(int(opts.filter_pids)),
        "FILTER_DEVS_VALUE": str(int(opts.filter_devices)),
        "EVENT_STRUCT": EVENT_C,
        "START_TRACEPOINT": opts.start_tracepoint,
        "RINGBUF_PAGES": str(opts.ringbuf_pages),
        "MAX_REQUESTS": str(opts.max_requests),
    }
    defines = "".join(f"#define {n} {opts.offsets.get(n, 0)}\n" for n in sorted(OFFSET_NAMES))
    text = defines + BPF_TEXT
    for placeholder, value in substitutions.items():
        text = text.replace(placeholder, value)
    return text.replace("BATCH", str(BATCH))
