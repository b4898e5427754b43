# SPDX-License-Identifier: Apache-2.0
"""The per-I/O block probe's kernel side: BPF texts and the pure render() that fills them.

Two keyings. `rq` (best): one program each on `block_io_start`, `block_rq_insert`,
`block_rq_merge`, `block_rq_issue` and two on `block_rq_complete`, keyed by the
`struct request *`. A request's state lives in a slot of a BPF array chosen by hashing the
pointer (an inlined lookup and a compare-and-swap, no hash-table lock); the rare request whose
slot is taken goes to a small hash table. Fields are read at offsets from the kernel's BTF:
as plain loads in `tp_btf` programs (probes/tp_btf.py), or through probe-read helpers in raw
tracepoint programs where the kernel has no BTF-typed tracepoints (`attach="raw_tp"`).
`dev_sector`: classic tracepoints keyed by (dev, sector), for kernels without raw tracepoints,
`block_io_start` or BTF. No kprobes, no hand-written tracepoint structs.

Every completion the kernel accounts becomes a record or a named loss (docs/probes.md, "Exact
or counted"): a request completed without having been issued itself (a pre-flush write that
the flush machinery finishes) is a record with no issue time; the data step of a flush
sequence is skipped because the kernel accounts the request only at its final completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Indexes of the `lost` array, also the manifest's lost_events keys (docs/probes.md); a
# complete_missed is counted per operation, at COMPLETE_MISSED + index in OPS.
LOST_KEYS = ("ringbuf_full", "map_full", "issued_before_start")
OPS = ("R", "W", "F", "D", "O")  # REQ_OP_* order: read, write, flush, discard, every other
COMPLETE_MISSED = len(LOST_KEYS)
BATCH = 32  # completions per ring-buffer record
# The completion programs of the rq keying: the kernel runs a raw tracepoint / tp_btf program
# at most once per CPU at a time, so a completion that interrupts one goes to the other (which
# otherwise returns at its first check).
COMPLETE_PROGRAMS = ("pio_complete", "pio_complete_twin")
# rq keying: tracepoint -> program, in attach order (completions last: nothing completes
# before its issue is followed).
RQ_PROGRAMS = (("block_io_start", "pio_start"), ("block_rq_merge", "pio_merge"),
               ("block_rq_requeue", "pio_requeue"),
               ("block_rq_issue", "pio_issue"),
               *(("block_rq_complete", name) for name in COMPLETE_PROGRAMS))
ATTACHES = ("tp_btf", "raw_tp")
PID_BITMAP_WORDS = 65536  # bit per tgid below 4194304 (the kernel's largest pid_max)

# One completed request as the probes send it to userspace (EVENT_DTYPE below); also the
# aggregate probe's row record.
EVENT_C = """struct event_t {
    u64 start_ns; u64 insert_ns; u64 issue_ns; u64 complete_ns; u64 sector;
    u32 dev; u32 bytes; u32 tgid; u32 tid; s32 error; u32 tracked;
    char comm[16]; char rwbs[8];
};"""

COMMON_TEXT = r"""
#include <uapi/linux/ptrace.h>

#define FILTER_PIDS FILTER_PIDS_VALUE
#define FILTER_DEVS FILTER_DEVS_VALUE

EVENT_STRUCT
/* Completions are batched per CPU so userspace handles one ring-buffer record per BATCH. */
struct batch_t { u32 n; u32 pad; struct event_t ev[BATCH]; };

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(pending, struct batch_t, 2);   /* one per completion program (twins) */
BPF_ARRAY(lost, u64, NLOST);
BPF_HASH(devs, u32, u8, 64);

static inline void count_lost(int index, u64 n) {
    u64 *c = lost.lookup(&index);
    if (c) lock_xadd(c, n);
}

/* The next free record of this CPU's batch for completion program `slot`, or NULL. */
static inline struct event_t *next_event(u32 slot, struct batch_t **batch) {
    struct batch_t *b = pending.lookup(&slot);
    if (!b || b->n >= BATCH) return 0;
    *batch = b;
    return &b->ev[b->n];
}

static inline void commit_event(struct batch_t *b) {
    b->n++;
    if (b->n == BATCH) {
        if (events.ringbuf_output(b, sizeof(*b), BPF_RB_NO_WAKEUP) < 0) count_lost(0, BATCH);
        b->n = 0;
    }
}

static inline char op_letter(u32 op) {
    return op == 0 ? 'R' : op == 1 ? 'W' : op == 2 ? 'F' : op == 3 ? 'D' : 'O';
}

/* A followed request issued whose completion no program of ours saw, per operation. */
static inline void count_missed(u32 op) {
    count_lost(COMPLETE_MISSED + (op < 4 ? op : 4), 1);
}
"""

RQ_TEXT = r"""
#define TP_BTF TP_BTF_VALUE
#define FLUSH_SEQ_BIT FLUSH_SEQ_BIT_VALUE   /* __RQF_FLUSH_SEQ, -1 when BTF has no rqf_flags */
#define REQ_OP_FLUSH 2

/* One cache line per request, written at submission and issue, read at completion (often on
 * another CPU): nothing else shares the line. */
struct slot_t {
    u64 rq;   /* the request that owns the slot, 0: free */
    u64 start_ns; u64 issue_ns; u64 sector;
    u32 dev; u32 bytes; u32 tgid; u32 tid;
    u8 tracked; u8 requeued; u8 op; u8 pad8; u32 pad32; u64 pad64;
} __attribute__((aligned(64)));
struct comm_t { char comm[16]; };

BPF_ARRAY(slots, struct slot_t, NSLOTS);
/* Thread names by tid, taken once per thread (bpf_get_current_comm is among the costliest
 * steps of a submission); the last tid seen on each CPU skips even the lookup. */
BPF_HASH(comms, u32, struct comm_t, MAX_SPILL);
BPF_PERCPU_ARRAY(last_tid, u32, 1);
BPF_HASH(spill, u64, struct slot_t, MAX_SPILL);   /* requests whose array slot was taken */
BPF_ARRAY(spilled, s64, 1);                      /* live spill entries: 0 skips the table */
#if FILTER_PIDS
BPF_ARRAY(pid_bits, u64, PID_BITMAP_WORDS_VALUE); /* bit per followed tgid */
#endif
/* Direct-mapped cache in front of `devs` (an array lookup is inlined, a hash lookup is a
 * call): one u64 per entry holding dev_t and 1 + probed, so an update is never torn. */
BPF_ARRAY(dev_cache, u64, 256);
/* Per CPU, the request pio_complete is on, written as it starts: the twin's one check. */
BPF_PERCPU_ARRAY(completing, u64, 1);

#if TP_BTF
/* tp_btf programs: the verifier types the arguments from BTF, so a field is a plain load. */
#define U64(base, offset) (*(u64 *)((char *)(base) + (offset)))
#define U32(base, offset) (*(u32 *)((char *)(base) + (offset)))
#define PTR(base, offset) (*(void **)((char *)(base) + (offset)))
#else
static inline u64 U64(void *base, u32 offset) {
    u64 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (char *)base + offset);
    return v;
}
static inline u32 U32(void *base, u32 offset) {
    u32 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (char *)base + offset);
    return v;
}
#define PTR(base, offset) ((void *)U64(base, offset))
#endif

/* Whole-disk dev_t of a request, rq->q->disk->{major, first_minor}, as block events report. */
static inline u32 request_dev(void *rq) {
    void *q = PTR(rq, REQUEST_Q);
    if (!q) return 0;
    void *disk = PTR(q, REQUEST_QUEUE_DISK);
    if (!disk) return 0;
    return (U32(disk, GENDISK_MAJOR) << 20) | U32(disk, GENDISK_FIRST_MINOR);
}

static inline int probed(u32 dev) {
    if (!FILTER_DEVS) return 1;
    u32 at = (dev ^ (dev >> 8) ^ (dev >> 20)) & 255;
    u64 *entry = dev_cache.lookup(&at);
    if (!entry) return 0;
    u64 seen = *entry;
    if (seen && (u32)(seen >> 32) == dev) return (u32)seen - 1;
    int yes = devs.lookup(&dev) != 0;
    *entry = ((u64)dev << 32) | (yes + 1);
    return yes;
}

/* Slot of a request. tp_btf: its tag (the scheduler's when there is one, fixed from
 * allocation to completion) after a region per (disk, hardware queue), so the requests in
 * flight use a few hot cache lines instead of lines scattered over the table (a tp_btf program
 * may not do arithmetic on the pointer anyway). raw_tp: a multiplicative hash of the address
 * (every field read costs a helper call there). Requests that meet in one slot (a flush
 * request borrows its first writer's tag) are told apart by the owner the slot records. */
static inline u32 slot_index(u64 rq) {
#if TP_BTF
    void *r = (void *)rq;
    s32 tag = (s32)U32(r, REQUEST_INTERNAL_TAG);
    if (tag < 0) tag = (s32)U32(r, REQUEST_TAG);
    void *hctx = PTR(r, REQUEST_MQ_HCTX);
    u32 queue = hctx ? U32(hctx, BLK_MQ_HW_CTX_QUEUE_NUM) : 0;
    u32 region = (u32)(((request_dev(r) ^ (queue << 12)) * 0x9E3779B1U) >> 22) << 10;
    return (region + (u32)tag) & ((1U << SLOT_BITS) - 1);
#else
    return (u32)((rq * 0x9E3779B97F4A7C15ULL) >> (64 - SLOT_BITS));
#endif
}

/* The slot following `rq`, or NULL; *spilt says whether it is in the spill table. */
static inline struct slot_t *find(u64 rq, int *spilt) {
    u32 i = slot_index(rq);
    struct slot_t *s = slots.lookup(&i);
    *spilt = 0;
    if (s && s->rq == rq) return s;
    int zero = 0;
    s64 *n = spilled.lookup(&zero);
    if (!n || *n <= 0) return 0;
    *spilt = 1;
    return spill.lookup(&rq);
}

static inline void clear(struct slot_t *s) {
    s->start_ns = 0; s->issue_ns = 0; s->sector = 0;
    s->dev = 0; s->bytes = 0; s->tgid = 0; s->tid = 0; s->tracked = 0; s->op = 0;
    s->requeued = 0;
}

static inline void remember_comm(u32 tid) {
    int zero = 0;
    u32 *last = last_tid.lookup(&zero);
    if (!last || *last == tid) return;
    *last = tid;
    if (comms.lookup(&tid)) return;
    struct comm_t c = {};
    bpf_get_current_comm(&c.comm, sizeof(c.comm));
    comms.update(&tid, &c);
}

/* A cleared slot owned by `rq`, or NULL (counted as map_full). A slot still owned by this
 * very request is from its previous life: if that was issued, the kernel ended it without a
 * completion any BPF program saw (measured: an independent program on the same tracepoints
 * sees none either), so it is counted as complete_missed. */
static inline struct slot_t *claim(u64 rq, int *spilt) {
    u32 i = slot_index(rq);
    struct slot_t *s = slots.lookup(&i);
    *spilt = 0;
    if (!s) return 0;
    u64 owner = __sync_val_compare_and_swap(&s->rq, 0, rq);
    if (owner && owner != rq) {
        struct slot_t fresh = {};
        fresh.rq = rq;
        *spilt = 1;
        if (spill.insert(&rq, &fresh) == 0) {
            int zero = 0;
            s64 *n = spilled.lookup(&zero);
            if (n) lock_xadd(n, 1);
        }
        s = spill.lookup(&rq);
        if (!s) { count_lost(1, 1); return 0; }
        owner = rq;
    }
    if (owner == rq && s->issue_ns && s->tracked) count_missed(s->op);
    clear(s);
    return s;
}

static inline void release(u64 rq, struct slot_t *s, int spilt) {
    if (spilt) {
        if (spill.delete(&rq) == 0) {
            int zero = 0;
            s64 *n = spilled.lookup(&zero);
            if (n) lock_xadd(n, -1);
        }
        return;
    }
    asm volatile("" ::: "memory");   /* every read of the slot happens before it is freed */
    *(volatile u64 *)&s->rq = 0;
}

/* Submission (block_io_start): the only place the task that wants the I/O is current. */
int pio_start(u64 *ctx) {
    u64 id = bpf_get_current_pid_tgid();
#if FILTER_PIDS
    u32 word = (id >> 32) >> 6;
    u64 *bits = pid_bits.lookup(&word);
    if (!bits || !((*bits >> ((id >> 32) & 63)) & 1)) return 0;
#endif
    int spilt;
    struct slot_t *s = claim(ctx[0], &spilt);
    if (!s) return 0;
    s->start_ns = bpf_ktime_get_ns();
    s->tgid = id >> 32;
    s->tid = (u32)id;
    s->tracked = 1;
    remember_comm((u32)id);
    return 0;
}

/* A request merged into another is freed without issue or completion: forget it. */
int pio_merge(u64 *ctx) {
    int spilt;
    struct slot_t *s = find(ctx[0], &spilt);
    if (s) release(ctx[0], s, spilt);
    return 0;
}

/* A request put back after its issue (driver busy) is issued again: not a new request. */
int pio_requeue(u64 *ctx) {
    int spilt;
    struct slot_t *s = find(ctx[0], &spilt);
    if (s) s->requeued = 1;
    return 0;
}

/* Issue: every request on the probed disks is followed from here, for the depth series. A
 * requeued request is issued again and keeps its latest issue; one issued again without a
 * requeue (the flush request, which never starts) ended unseen in between. */
int pio_issue(u64 *ctx) {
    void *rq = (void *)ctx[0];
    u32 dev = request_dev(rq);
    int spilt;
    struct slot_t *s = find(ctx[0], &spilt);
    if (!probed(dev)) {
        if (s) release(ctx[0], s, spilt);
        return 0;
    }
    if (!s) {
        s = claim(ctx[0], &spilt);
        if (!s) return 0;
        s->tracked = !FILTER_PIDS;
    } else if (s->issue_ns && !s->requeued) {
        if (s->tracked) count_missed(s->op);
        clear(s);
        s->tracked = !FILTER_PIDS;
    }
    s->requeued = 0;
    s->issue_ns = bpf_ktime_get_ns();
    s->dev = dev;
    s->sector = U64(rq, REQUEST___SECTOR);
    s->bytes = U32(rq, REQUEST___DATA_LEN);
    s->op = U32(rq, REQUEST_CMD_FLAGS) & 0xff;   /* REQ_OP_MASK */
    return 0;
}

static inline int on_complete(u64 *ctx, u32 program) {
    void *rq = (void *)ctx[0];
    int spilt;
    struct slot_t *s = find(ctx[0], &spilt);
    if (!s) {
        /* The twin finds nothing after every completion the first program took. */
        if (program == 0 && probed(request_dev(rq))) count_lost(2, 1);
        return 0;
    }
    u32 left = U32(rq, REQUEST___DATA_LEN);
    if ((u32)ctx[2] < left) return 0;   /* partial: more to come */
    u32 op = U32(rq, REQUEST_CMD_FLAGS) & 0xff;
#if FLUSH_SEQ_BIT >= 0
    /* The data step of a flush sequence: the kernel accounts the request when the sequence
     * ends (blk_account_io_done skips RQF_FLUSH_SEQ), and so does the probe. */
    if (op != REQ_OP_FLUSH && (U32(rq, REQUEST_RQ_FLAGS) >> FLUSH_SEQ_BIT) & 1) return 0;
#endif
    u32 dev = s->dev;
    u64 sector = s->sector;
    u32 bytes = s->bytes;
    /* Values, not pointers, are chosen below: one load instruction may not read both a map
     * value and a kernel struct (the verifier refuses it). */
    asm volatile("" : "+r"(dev), "+r"(sector), "+r"(bytes));
    if (!s->issue_ns) {   /* finished without an issue of its own (a pre-flush write) */
        dev = request_dev(rq);
        if (!probed(dev)) { release(ctx[0], s, spilt); return 0; }
        sector = U64(rq, REQUEST___SECTOR);
        bytes = left;
    }
    struct batch_t *b = 0;
    struct event_t *e = next_event(program, &b);
    if (!e || !b) return 0;
    e->complete_ns = bpf_ktime_get_ns();
    e->start_ns = s->start_ns; e->insert_ns = 0; e->issue_ns = s->issue_ns;
    e->sector = sector; e->dev = dev; e->bytes = bytes; e->tgid = s->tgid; e->tid = s->tid;
    e->error = -(s32)(u8)ctx[1];   /* blk_status_t, mapped to an errno in userspace */
    e->tracked = s->tracked;
    *(u64 *)e->rwbs = op_letter(op);   /* comm: from `comms` by tid, in userspace */
    release(ctx[0], s, spilt);
    commit_event(b);
    return 0;
}

int pio_complete(u64 *ctx) {
    int zero = 0;
    u64 *on = completing.lookup(&zero);
    if (on) *on = ctx[0];
    return on_complete(ctx, 0);
}

/* Runs after pio_complete on every completion, and works only when pio_complete did not start
 * on this request: the kernel skipped it because it was busy on this CPU. (A completion that
 * lands before pio_complete's first store, of the request it finished last on this CPU, is
 * skipped by both; its slot stays and is counted as complete_missed or unfinished_at_stop.) */
int pio_complete_twin(u64 *ctx) {
    int zero = 0;
    u64 *on = completing.lookup(&zero);
    if (on && *on == ctx[0]) return 0;
    return on_complete(ctx, 1);
}
"""

DEV_SECTOR_TEXT = r"""
typedef struct { u32 dev; u32 pad; u64 sector; } rqkey_t;
struct req_t {
    u64 start_ns; u64 insert_ns; u64 issue_ns; u64 sector;
    u32 dev; u32 bytes; u32 tgid; u32 tid; char comm[16]; char rwbs[8]; u32 tracked;
};
BPF_HASH(reqs, rqkey_t, struct req_t, MAX_SPILL);
BPF_HASH(pids, u32, u8, 1024);

TRACEPOINT_PROBE(block, START_TRACEPOINT) {
    rqkey_t key = {.dev = args->dev, .sector = args->sector};
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (FILTER_PIDS && !pids.lookup(&tgid)) return 0;
    struct req_t r = {};
    r.start_ns = bpf_ktime_get_ns();
    r.tgid = tgid;
    r.tid = (u32)id;
    r.tracked = 1;
    bpf_get_current_comm(&r.comm, sizeof(r.comm));
    if (reqs.update(&key, &r) < 0) count_lost(1, 1);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_insert) {
    rqkey_t key = {.dev = args->dev, .sector = args->sector};
    struct req_t *r = reqs.lookup(&key);
    if (r) r->insert_ns = bpf_ktime_get_ns();
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_merge) {
    rqkey_t key = {.dev = args->dev, .sector = args->sector};
    reqs.delete(&key);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_issue) {
    rqkey_t key = {.dev = args->dev, .sector = args->sector};
    u32 dev = args->dev;
    if (FILTER_DEVS && !devs.lookup(&dev)) { reqs.delete(&key); return 0; }
    struct req_t *r = reqs.lookup(&key);
    if (!r) {
        struct req_t fresh = {};
        fresh.tracked = !FILTER_PIDS;
        if (reqs.update(&key, &fresh) < 0) { count_lost(1, 1); return 0; }
        r = reqs.lookup(&key);
        if (!r) return 0;
    }
    r->issue_ns = bpf_ktime_get_ns();
    r->dev = dev; r->sector = args->sector; r->bytes = args->bytes;
    bpf_probe_read_kernel(&r->rwbs, sizeof(r->rwbs), args->rwbs);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_complete) {
    u32 dev = args->dev;
    u64 sector = args->sector;
    s32 error = args->error;   /* already a negative errno */
    asm volatile("" : "+r"(dev), "+r"(sector), "+r"(error));   /* values, not ctx pointers */
    rqkey_t key = {.dev = dev, .sector = sector};
    struct req_t *r = reqs.lookup(&key);
    if (!r) {
        if (!FILTER_DEVS || devs.lookup(&dev)) count_lost(2, 1);
        return 0;
    }
    struct batch_t *b = 0;
    struct event_t *e = next_event(0, &b);
    if (!e || !b) return 0;
    e->complete_ns = bpf_ktime_get_ns();
    e->start_ns = r->start_ns; e->insert_ns = r->insert_ns; e->issue_ns = r->issue_ns;
    e->sector = sector; e->dev = dev;
    e->bytes = r->bytes; e->tgid = r->tgid; e->tid = r->tid;
    e->error = error;
    e->tracked = r->tracked;
    __builtin_memcpy(e->comm, r->comm, sizeof(e->comm));
    bpf_probe_read_kernel(&e->rwbs, sizeof(e->rwbs), args->rwbs);
    reqs.delete(&key);
    commit_event(b);
    return 0;
}
"""

RQ_OFFSETS = {"REQUEST_Q", "REQUEST_CMD_FLAGS", "REQUEST_RQ_FLAGS", "REQUEST___DATA_LEN",
              "REQUEST___SECTOR", "REQUEST_TAG", "REQUEST_INTERNAL_TAG", "REQUEST_MQ_HCTX",
              "BLK_MQ_HW_CTX_QUEUE_NUM", "REQUEST_QUEUE_DISK", "GENDISK_MAJOR",
              "GENDISK_FIRST_MINOR"}

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
# struct slot_t of the rq keying, to find the requests still followed when the probe stops.
SLOT_DTYPE = np.dtype(
    {"names": ["rq", "start_ns", "issue_ns", "sector", "dev", "bytes", "tgid", "tid", "tracked",
               "requeued", "op"],
     "formats": ["<u8", "<u8", "<u8", "<u8", "<u4", "<u4", "<u4", "<u4", "u1", "u1", "u1"],
     "offsets": [0, 8, 16, 24, 32, 36, 40, 44, 48, 49, 50], "itemsize": 64})


@dataclass(frozen=True)
class BlockOptions:
    """What the block probe attaches to and keeps (filled by detection and the caller)."""

    key: str = "rq"  # "rq" (request pointer, BTF offsets) or "dev_sector" (classic only)
    attach: str = "tp_btf"  # rq key: "tp_btf" (plain field loads) or "raw_tp" (probe reads)
    start_tracepoint: str = "block_io_start"  # or "block_getrq" on kernels before 6.5
    filter_pids: bool = False
    filter_devices: bool = False
    # 32 MiB: ~10k batches, 320k completions, over 1 s of this VM's top IOPS between drains. 4 MiB
    # (0.15 s) overflowed when the 2-CPU host kept the drain thread off a CPU (docs/probes.md,
    # "Exact or counted"); the space is locked memory only while the probe runs.
    ringbuf_pages: int = 8192
    slot_bits: int = 14  # rq key: 16384 slots, more than the requests a host has in flight
    max_spill: int = 16384  # requests followed beside the slots (all of them, dev_sector key)
    offsets: dict[str, int] = field(default_factory=dict)  # probes.btf.kernel_offsets(), rq only
    flush_seq_bit: int = -1  # rq key: bit of __RQF_FLUSH_SEQ in rq_flags (probes.btf)


def render(opts: BlockOptions) -> str:
    """The exact program loaded for `opts` (also what `kvscope probe --ebpf` prints)."""
    if opts.key not in ("rq", "dev_sector"):
        raise ValueError(f"block probe key {opts.key!r}: expected 'rq' or 'dev_sector'")
    if opts.attach not in ATTACHES:
        raise ValueError(f"block probe attach {opts.attach!r}: expected one of {ATTACHES}")
    missing = sorted(RQ_OFFSETS - set(opts.offsets)) if opts.key == "rq" else []
    if missing:
        raise ValueError(f"key 'rq' needs struct offsets {missing} (probes.btf.kernel_offsets())")
    if opts.ringbuf_pages & (opts.ringbuf_pages - 1):
        raise ValueError(f"ringbuf_pages {opts.ringbuf_pages}: must be a power of two")
    if not 4 <= opts.slot_bits <= 24:
        raise ValueError(f"slot_bits {opts.slot_bits}: expected 4..24")
    substitutions = {
        "FILTER_PIDS_VALUE": str(int(opts.filter_pids)),
        "FILTER_DEVS_VALUE": str(int(opts.filter_devices)),
        "TP_BTF_VALUE": str(int(opts.attach == "tp_btf")),
        "FLUSH_SEQ_BIT_VALUE": str(opts.flush_seq_bit),
        "EVENT_STRUCT": EVENT_C,
        "START_TRACEPOINT": opts.start_tracepoint,
        "RINGBUF_PAGES": str(opts.ringbuf_pages),
        "PID_BITMAP_WORDS_VALUE": str(PID_BITMAP_WORDS),
        "NSLOTS": str(1 << opts.slot_bits),
        "SLOT_BITS": str(opts.slot_bits),
        "MAX_SPILL": str(opts.max_spill),
        "NLOST": str(len(LOST_KEYS) + len(OPS)),
        "COMPLETE_MISSED": str(COMPLETE_MISSED),
    }
    body = RQ_TEXT if opts.key == "rq" else DEV_SECTOR_TEXT
    defines = "".join(f"#define {n} {opts.offsets.get(n, 0)}\n" for n in sorted(RQ_OFFSETS))
    text = (defines if opts.key == "rq" else "") + COMMON_TEXT + body
    for placeholder, value in substitutions.items():
        text = text.replace(placeholder, value)
    return text.replace("BATCH", str(BATCH))
