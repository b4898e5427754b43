# SPDX-License-Identifier: Apache-2.0
"""The NVMe probe's kernel side: nvme_setup_cmd / nvme_complete_rq records into one ring buffer.

The kernel only copies fields; joining setup to completion on (ctrl, qid, cid & 0xfff), decoding
cdw10..15 and the per-queue depth all happen in probes/nvme.py, in pure functions that are tested
on recorded events (this CI machine has no NVMe). These are classic tracepoints of the nvme-core
module, so they work whether nvme-core is built in or a module, over PCIe and NVMe-oF alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SETUP, COMPLETE = 0, 1

BPF_TEXT = r"""
struct nvme_event_t {
    u64 ts_ns; u32 kind; s32 ctrl_id; s32 qid; u32 cid; u32 opcode; u32 fctype; u32 nsid;
    u32 status; u8 cdw10[24]; char disk[32];
};

BPF_RINGBUF_OUTPUT(nvme_events, RINGBUF_PAGES);
BPF_ARRAY(nvme_lost, u64, 1);

static inline void nvme_submit(struct nvme_event_t *e) {
    if (nvme_events.ringbuf_output(e, sizeof(*e), BPF_RB_NO_WAKEUP) < 0) {
        int zero = 0;
        u64 *n = nvme_lost.lookup(&zero);
        if (n) lock_xadd(n, 1);
    }
}

TRACEPOINT_PROBE(nvme, nvme_setup_cmd) {
    struct nvme_event_t e = {};
    e.ts_ns = bpf_ktime_get_ns();
    e.kind = SETUP_KIND;
    e.ctrl_id = args->ctrl_id; e.qid = args->qid; e.cid = args->cid;
    e.opcode = args->opcode; e.fctype = args->fctype; e.nsid = args->nsid;
    bpf_probe_read_kernel(&e.cdw10, sizeof(e.cdw10), args->cdw10);
    bpf_probe_read_kernel(&e.disk, sizeof(e.disk), args->disk);
    nvme_submit(&e);
    return 0;
}

TRACEPOINT_PROBE(nvme, nvme_complete_rq) {
    struct nvme_event_t e = {};
    e.ts_ns = bpf_ktime_get_ns();
    e.kind = COMPLETE_KIND;
    e.ctrl_id = args->ctrl_id; e.qid = args->qid; e.cid = args->cid; e.status = args->status;
    bpf_probe_read_kernel(&e.disk, sizeof(e.disk), args->disk);
    nvme_submit(&e);
    return 0;
}
"""

NVME_DTYPE = np.dtype(
    [
        ("ts_ns", "<u8"), ("kind", "<u4"), ("ctrl_id", "<i4"), ("qid", "<i4"), ("cid", "<u4"),
        ("opcode", "<u4"), ("fctype", "<u4"), ("nsid", "<u4"), ("status", "<u4"),
        ("cdw10", "u1", (24,)), ("disk", "S32"),
    ],
    align=True,
)


@dataclass(frozen=True)
class NvmeOptions:
    ringbuf_pages: int = 1024


def render(opts: NvmeOptions) -> str:
    """The exact NVMe program loaded for `opts`."""
    if opts.ringbuf_pages & (opts.ringbuf_pages - 1):
        raise ValueError(f"ringbuf_pages {opts.ringbuf_pages}: must be a power of two")
    return (BPF_TEXT.replace("RINGBUF_PAGES", str(opts.ringbuf_pages))
            .replace("SETUP_KIND", str(SETUP)).replace("COMPLETE_KIND", str(COMPLETE)))
