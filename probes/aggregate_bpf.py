# SPDX-License-Identifier: Apache-2.0
"""The aggregate (always-on) block probe's kernel side: BPF text and its pure render().

Cheap enough for every I/O of a busy host because it keeps no state per request (after Tanel
Poder's "Optimizing eBPF I/O latency accounting when running 37M IOPS", 2025): one program on
`block_rq_complete` reads the kernel's own timestamps from the `struct request`
(`start_time_ns`, stamped when the request starts, and `io_start_time_ns`, when it is issued to
the driver) and adds the request to per-CPU counters and log2 histograms of its disk: no hash
entry per request, no atomics, one program per I/O instead of five. The programs are tp_btf
(BTF-typed tracepoints, probes/tp_btf.py), so fields are plain loads at offsets from BTF, not
probe-read helper calls. Only requests submitted by the tracked thread / process ids are also
followed from `block_io_start`, emitted as per-I/O rows (the per-I/O probe's record layout) and
counted again under their process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.contract.rundir import IO_TOTALS_COUNTERS
from kvscope.probes.block_bpf import EVENT_C

# Operations (REQ_OP_* order: read, write, flush, discard, then every other op).
OPS = ("R", "W", "F", "D", "O")
KINDS = ("queue", "service")  # start_time_ns -> io_start_time_ns, io_start_time_ns -> complete
SLOTS = 32  # log2(us) buckets as bcc's bpf_log2l: slot k holds [2^(k-1), 2^k) us, slot 1 also 0
MAX_DEVS = 64
# One stats record (u64 counters): per op the scalar counters, then the histograms.
SCALARS = IO_TOTALS_COUNTERS
HIST_BASE = len(SCALARS) * len(OPS)
NSTATS = HIST_BASE + len(OPS) * len(KINDS) * SLOTS
# The programs and the tracepoints they attach to (tp_btf), in attach order.
PROGRAMS = {"block_rq_complete": "agg_block_rq_complete"}
TRACKING_PROGRAMS = {"block_io_start": "agg_block_io_start",
                     "block_rq_merge": "agg_block_rq_merge", **PROGRAMS}
# Indexes of the `lost` array, also manifest lost_events keys.
LOST_KEYS = ("ringbuf_full", "map_full", "disk_added")
PID_BITMAP_WORDS = 65536  # bit per id below 4194304 (the kernel's largest pid_max)
OFFSET_NAMES = {"REQUEST_Q", "REQUEST_CMD_FLAGS", "REQUEST___DATA_LEN", "REQUEST___SECTOR",
                "REQUEST_START_TIME_NS", "REQUEST_IO_START_TIME_NS", "REQUEST_QUEUE_DISK",
                "GENDISK_MAJOR", "GENDISK_FIRST_MINOR"}

BPF_TEXT = r"""
#include <uapi/linux/ptrace.h>

#define TRACK TRACK_VALUE
#define TRACK_TIDS TRACK_TIDS_VALUE   /* some tracked id is a thread, not a process */
#define FILTER_DEVS FILTER_DEVS_VALUE
/* A struct field read straight from kernel memory: these are tp_btf programs, whose
 * arguments the verifier types from BTF (probes/tp_btf.py), so no probe-read helper call. */
#define FIELD(T, base, offset) (*(T *)((char *)(base) + (offset)))

EVENT_STRUCT
struct stats_t { u64 v[NSTATS_VALUE]; };
struct pkey_t { u32 tgid; u32 idx; };
struct tracked_t { u64 submit_ns; u32 tgid; u32 tid; char comm[16]; };

BPF_PERCPU_ARRAY(dev_stats, struct stats_t, MAX_DEVS_VALUE);   /* index 0: not probed */
BPF_HASH(dev_idx, u32, u32, MAX_DEVS_VALUE);                  /* dev_t -> index */
BPF_ARRAY(lost, u64, 3);
/* Direct-mapped cache in front of dev_idx (an array lookup is inlined, a hash lookup is a
 * call): one u64 per entry holding dev_t and index, so an update is never torn. */
BPF_ARRAY(dev_cache, u64, 256);

static inline void count_lost(int index) {
    u64 *c = lost.lookup(&index);
    if (c) lock_xadd(c, 1);
}

/* Stats index of a request's whole disk, rq->q->disk->{major, first_minor}; 0: not probed. */
static inline u32 disk_index(void *rq) {
    void *q = FIELD(void *, rq, REQUEST_Q);
    if (!q) return 0;
    void *disk = FIELD(void *, q, REQUEST_QUEUE_DISK);
    if (!disk) return 0;
    u32 dev = (FIELD(u32, disk, GENDISK_MAJOR) << 20) | FIELD(u32, disk, GENDISK_FIRST_MINOR);
    u32 slot = (dev ^ (dev >> 8) ^ (dev >> 20)) & 255;
    u64 *entry = dev_cache.lookup(&slot);
    if (!entry) return 0;
    u64 seen = *entry;
    if (seen && (u32)(seen >> 32) == dev) return (u32)seen - 1;
    u32 *known = dev_idx.lookup(&dev);
    u32 idx = known ? *known : 0;
    if (!idx && !FILTER_DEVS) count_lost(2);   /* a disk added after the probe started */
    *entry = ((u64)dev << 32) | (idx + 1);
    return idx;
}

/* ns / 1000 by multiply and shift (a 64-bit divide costs ~20 ns here): exact below 2^32 ns,
 * since 2199023256 = ceil(2^41 / 1000) errs by 448 / 2^41 per ns. */
static inline u64 to_us(u64 ns) {
    return ns < (1ULL << 32) ? (ns * 2199023256ULL) >> 41 : ns / 1000;
}

static inline u32 log2_slot(u64 ns) {
    u32 slot = bpf_log2l(to_us(ns));
    return slot < SLOTS_VALUE ? slot : SLOTS_VALUE - 1;
}

/* Add one request to a stats record; ATOMIC_ADD for records shared between CPUs. */
#define ACCOUNT(s, op, bytes, start, issue, now, ADD) do {                                   \
    ADD(&(s)->v[0 * NOPS + op], 1);                                                          \
    ADD(&(s)->v[1 * NOPS + op], bytes);                                                      \
    if (!(issue)) { ADD(&(s)->v[5 * NOPS + op], 1); }                                        \
    else {                                                                                   \
        ADD(&(s)->v[3 * NOPS + op], (now) - (issue));                                        \
        ADD(&(s)->v[HIST_BASE + (op * 2 + 1) * SLOTS_VALUE + log2_slot((now) - (issue))], 1);\
    }                                                                                        \
    if (!(start) || !(issue)) { if (!(start)) ADD(&(s)->v[4 * NOPS + op], 1); }              \
    else {                                                                                   \
        ADD(&(s)->v[2 * NOPS + op], (issue) - (start));                                      \
        ADD(&(s)->v[HIST_BASE + (op * 2) * SLOTS_VALUE + log2_slot((issue) - (start))], 1);  \
    }                                                                                        \
} while (0)
#define PLAIN_ADD(p, n) (*(p) += (n))
#define ATOMIC_ADD(p, n) lock_xadd((p), (n))

#if TRACK
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_ARRAY(track_ids, u64, PID_BITMAP_WORDS_VALUE);   /* bit per tracked tgid or tid */
BPF_HASH(tracked, u64, struct tracked_t, MAX_TRACKED);
BPF_HASH(proc_stats, struct pkey_t, struct stats_t, 1024);
BPF_ARRAY(tracked_inflight, s64, 1);
BPF_ARRAY(zero_stats, struct stats_t, 1);

static inline int is_tracked(u32 id) {
    u32 word = id >> 6;
    u64 *bits = track_ids.lookup(&word);
    return bits && (*bits >> (id & 63)) & 1;
}

/* tp_btf/block_io_start (rq): submission, in the task that wants the I/O, the only place
 * its ids are known. */
int agg_block_io_start(u64 *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if (!is_tracked(id >> 32) && !(TRACK_TIDS && is_tracked((u32)id))) return 0;
    u64 key = ctx[0];
    struct tracked_t t = {};
    t.submit_ns = bpf_ktime_get_ns();
    t.tgid = id >> 32;
    t.tid = (u32)id;
    bpf_get_current_comm(&t.comm, sizeof(t.comm));
    if (tracked.update(&key, &t) < 0) { count_lost(1); return 0; }
    int zero = 0;
    s64 *n = tracked_inflight.lookup(&zero);
    if (n) lock_xadd(n, 1);
    return 0;
}

static inline void forget(u64 *key) {
    if (tracked.delete(key) == 0) {
        int zero = 0;
        s64 *n = tracked_inflight.lookup(&zero);
        if (n) lock_xadd(n, -1);
    }
}

/* tp_btf/block_rq_merge (rq): a request merged into another is freed without completion. */
int agg_block_rq_merge(u64 *ctx) {
    int zero = 0;
    s64 *n = tracked_inflight.lookup(&zero);
    u64 key = ctx[0];
    if (n && *n > 0) forget(&key);
    return 0;
}

static inline void complete_tracked(u64 *key, void *rq, u32 idx, u32 op, u32 bytes,
                                    u64 start, u64 issue, u64 now, s32 error) {
    struct tracked_t *t = tracked.lookup(key);
    if (!t) return;
    struct pkey_t pk = {.tgid = t->tgid, .idx = idx};
    int zero = 0;
    struct stats_t *zeros = zero_stats.lookup(&zero);   /* too big for the stack */
    if (!zeros) return;
    struct stats_t *ps = proc_stats.lookup_or_try_init(&pk, zeros);
    if (ps) ACCOUNT(ps, op, bytes, start, issue, now, ATOMIC_ADD);
    else count_lost(1);
    struct event_t e = {};
    /* The row's times as the per-I/O probe's: submission seen at block_io_start; issue from
     * the kernel's own stamp, which may be a plug-cached time before it (then: no queue). */
    e.start_ns = t->submit_ns;
    e.issue_ns = issue > t->submit_ns ? issue : (issue ? t->submit_ns : 0);
    e.complete_ns = now;
    e.sector = FIELD(u64, rq, REQUEST___SECTOR);
    e.dev = idx;   /* userspace maps the index back to the disk */
    e.bytes = bytes; e.tgid = t->tgid; e.tid = t->tid; e.error = error; e.tracked = 1;
    __builtin_memcpy(e.comm, t->comm, sizeof(e.comm));
    e.rwbs[0] = op == 0 ? 'R' : op == 1 ? 'W' : op == 2 ? 'F' : op == 3 ? 'D' : 'O';
    forget(key);
    if (events.ringbuf_output(&e, sizeof(e), BPF_RB_NO_WAKEUP) < 0) count_lost(0);
}
#endif

/* tp_btf/block_rq_complete (rq, error, nr_bytes): every completion, the only per-I/O work
 * of this mode. */
int agg_block_rq_complete(u64 *ctx) {
    void *rq = (void *)ctx[0];
    u32 bytes = FIELD(u32, rq, REQUEST___DATA_LEN);
    if ((u32)ctx[2] < bytes) return 0;   /* partial completion: more to come */
    u32 idx = disk_index(rq);
    if (!idx || idx >= MAX_DEVS_VALUE) return 0;
    struct stats_t *s = dev_stats.lookup(&idx);
    if (!s) return 0;
    u32 op = FIELD(u32, rq, REQUEST_CMD_FLAGS) & 0xff;   /* REQ_OP_MASK */
    if (op > 4) op = 4;
    u64 start = FIELD(u64, rq, REQUEST_START_TIME_NS);
    u64 issue = FIELD(u64, rq, REQUEST_IO_START_TIME_NS);
    u64 now = bpf_ktime_get_ns();
    ACCOUNT(s, op, bytes, start, issue, now, PLAIN_ADD);
#if TRACK
    int zero = 0;
    s64 *n = tracked_inflight.lookup(&zero);
    if (n && *n > 0) {
        u64 key = ctx[0];
        complete_tracked(&key, rq, idx, op, bytes, start, issue, now, -(s32)(u8)ctx[1]);
    }
#endif
    return 0;
}
"""


@dataclass(frozen=True)
class AggregateOptions:
    """What the aggregate probe keeps (filled by the probe from its ids, devices and BTF)."""

    track: bool = False  # per-I/O rows for the tracked ids (attaches block_io_start, _rq_merge)
    track_threads: bool = False  # some tracked id is a thread id: check tids too, not only tgids
    filter_devices: bool = False
    ringbuf_pages: int = 1024  # 4 MiB: tracked rows only (probes.aggregate.ROW_POLL_MS)
    max_tracked: int = 16384
    offsets: dict[str, int] = field(default_factory=dict)  # probes.btf aggregate offsets


def render(opts: AggregateOptions) -> str:
    """The exact program loaded for `opts`."""
    missing = sorted(OFFSET_NAMES - set(opts.offsets))
    if missing:
        raise ValueError(f"aggregate mode needs struct offsets {missing} "
                         f"(probes.btf.kernel_offsets(probes.btf.AGGREGATE_NEEDED))")
    if opts.ringbuf_pages & (opts.ringbuf_pages - 1):
        raise ValueError(f"ringbuf_pages {opts.ringbuf_pages}: must be a power of two")
    substitutions = {
        "TRACK_VALUE": str(int(opts.track)),
        "TRACK_TIDS_VALUE": str(int(opts.track_threads)),
        "FILTER_DEVS_VALUE": str(int(opts.filter_devices)),
        "EVENT_STRUCT": EVENT_C,
        "NSTATS_VALUE": str(NSTATS),
        "MAX_DEVS_VALUE": str(MAX_DEVS),
        "SLOTS_VALUE": str(SLOTS),
        "PID_BITMAP_WORDS_VALUE": str(PID_BITMAP_WORDS),
        "RINGBUF_PAGES": str(opts.ringbuf_pages),
        "MAX_TRACKED": str(opts.max_tracked),
        }
    defines = "".join(f"#define {n} {opts.offsets[n]}\n" for n in sorted(OFFSET_NAMES))
    defines += f"#define NOPS {len(OPS)}\n#define HIST_BASE {HIST_BASE}\n"
    text = defines + BPF_TEXT
    for placeholder, value in substitutions.items():
        text = text.replace(placeholder, value)
    return text

