# SPDX-License-Identifier: Apache-2.0
"""NVMe decoding and aggregation on recorded tracepoint events (this machine has no NVMe).

tests/probes/data/nvme_events.jsonl holds nvme_setup_cmd / nvme_complete_rq records with the
fields the probe copies, for a PCIe controller (nvme0) and an NVMe/TCP controller (nvme1);
tests/probes/data/sys is the matching slice of sysfs. See tests/probes/data/README.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvscope.probes import nvme
from kvscope.probes.nvme_bpf import NvmeOptions, render


@pytest.fixture(scope="module")
def decoded(recorded_nvme_data) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    records, sys_root = recorded_nvme_data
    result = nvme.decode(records, "cold", sys_root)
    return result.nvme_io, result.queue_depth, result.summary


def test_commands_join_on_tag_without_generation_bits_recorded_nvme_tracepoints(decoded) -> None:
    rows, _, summary = decoded
    lat = {(r.ctrl_id, r.qid, r.setup_ns % 10**7 // 1000): (r.complete_ns - r.setup_ns) // 1000
           for r in rows.itertuples()}
    # setup cid 0x1003 completes as 3 at 1500 us; tag 3 is then reused with generation 2
    assert lat[(0, 1, 1000)] == 500 and lat[(0, 1, 1600)] == 1000
    assert lat[(0, 1, 1100)] == 800
    assert lat[(1, 1, 2000)] == 500 and lat[(1, 1, 2050)] == 350 and lat[(1, 1, 2100)] == 600
    assert len(rows) == 8  # 9 setups, 9 completions, one of each unmatched
    assert (rows["cid"] < 0x1000).all()
    assert summary["unmatched"] == {"setup_without_completion": 1, "completion_without_setup": 1}


def test_bytes_status_and_transport_recorded_nvme_tracepoints(decoded) -> None:
    rows, _, _ = decoded
    assert set(rows.loc[rows["ctrl_id"] == 0, "transport"]) == {"pcie"}
    assert set(rows.loc[rows["ctrl_id"] == 1, "transport"]) == {"tcp"}
    io = rows[rows["qid"] > 0].set_index("setup_ns")["bytes"]
    assert sorted(io.tolist()) == [4096, 65536, 65536, 65536, 65536, 65536, 131072]
    fabrics = rows[rows["qid"] == 0]
    assert fabrics["opcode"].tolist() == [0x7F] and fabrics["bytes"].tolist() == [0]
    assert rows.loc[rows["status"] != 0, "status"].tolist() == [0x281]


def test_depth_per_hardware_queue_recorded_nvme_tracepoints(decoded) -> None:
    _, depth, summary = decoded
    peaks = depth.groupby(["device", "hw_queue"])["inflight"].max().to_dict()
    assert peaks == {("nvme0", 1): 2, ("nvme0", 2): 1, ("nvme1", 1): 3}
    last = depth.groupby(["device", "hw_queue"])["inflight"].last().to_dict()
    assert last == {("nvme0", 1): 0, ("nvme0", 2): 1, ("nvme1", 1): 0}  # 0x6002 still open
    assert set(depth["source"]) == {"bpf"}
    per_queue = {(q["ctrl_id"], q["qid"], q["opcode"]): q for q in summary["per_queue"]}
    tcp_reads = per_queue[(1, 1, 2)]
    assert tcp_reads["transport"] == "tcp" and tcp_reads["commands"] == 3
    assert tcp_reads["max_inflight"] == 3 and tcp_reads["max_us"] == 600
    assert json.loads(json.dumps(summary))["per_queue"]  # goes into the manifest as it is


def test_nvme_program_renders_both_tracepoints() -> None:
    text = render(NvmeOptions(ringbuf_pages=64))
    assert "TRACEPOINT_PROBE(nvme, nvme_setup_cmd)" in text
    assert "TRACEPOINT_PROBE(nvme, nvme_complete_rq)" in text
    assert "RINGBUF_PAGES" not in text and "_KIND" not in text
    with pytest.raises(ValueError, match="power of two"):
        render(NvmeOptions(ringbuf_pages=100))


VERIFY = """
from bcc import BPF
from kvscope.probes.nvme_bpf import NvmeOptions, render
BPF._trace_autoload = lambda self: None   # load and verify only: the tracepoints do not exist
bpf = BPF(text=render(NvmeOptions()).encode())
for name in (b"tracepoint__nvme__nvme_setup_cmd", b"tracepoint__nvme__nvme_complete_rq"):
    bpf.load_func(name, BPF.TRACEPOINT)
print("verified")
"""


@pytest.mark.root
def test_nvme_program_passes_the_verifier_with_recorded_tracepoint_formats(
        recorded_nvme_data) -> None:
    """bcc compiles the NVMe program against recorded format files (tmpfs over tracefs in a
    private mount namespace) and the kernel verifier loads both programs."""
    formats = recorded_nvme_data[1].parent / "tracefs"
    script = (f"for d in /sys/kernel/tracing /sys/kernel/debug; do mount -t tmpfs none $d; done; "
              f"cp -r {formats}/. /sys/kernel/tracing/; mkdir /sys/kernel/debug/tracing; "
              f"cp -r {formats}/. /sys/kernel/debug/tracing/; exec {sys.executable} -c '{VERIFY}'")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "verified", out.stderr[-3000:]
