# SPDX-License-Identifier: Apache-2.0
"""The BPF text and the pure record conversions, without root or BPF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvscope.probes import aggregate_bpf, aggregate_frames, btf, frames, sampler
from kvscope.probes.block_bpf import EVENT_DTYPE, RQ_OFFSETS, BlockOptions, render

OFFSETS = {name: 8 * i for i, name in enumerate(sorted(RQ_OFFSETS))}


@pytest.mark.parametrize(
    ("opts", "present"),
    [
        pytest.param(BlockOptions(offsets=OFFSETS, flush_seq_bit=1),
                     ["int pio_start(u64 *ctx)", "#define TP_BTF 1", "#define FILTER_PIDS 0",
                      "#define FLUSH_SEQ_BIT 1",
                      f"#define REQUEST_QUEUE_DISK {OFFSETS['REQUEST_QUEUE_DISK']}"], id="rq"),
        pytest.param(BlockOptions(offsets=OFFSETS, attach="raw_tp", filter_pids=True),
                     ["#define TP_BTF 0", "bpf_probe_read_kernel", "#define FILTER_PIDS 1",
                      "BPF_ARRAY(pid_bits"], id="rq-raw-tp"),
        pytest.param(BlockOptions(key="dev_sector", start_tracepoint="block_getrq",
                                  filter_pids=True, filter_devices=True),
                     ["TRACEPOINT_PROBE(block, block_getrq)", "#define FILTER_PIDS 1",
                      "#define FILTER_DEVS 1"], id="dev-sector"),
    ],
)
def test_render_fills_every_placeholder(opts: BlockOptions, present: list[str]) -> None:
    text = render(opts)
    for snippet in present:
        assert snippet in text
    for placeholder in ("_VALUE", "START_TRACEPOINT", "RINGBUF_PAGES", "NSLOTS", "SLOT_BITS",
                        "MAX_SPILL", "NLOST", "EVENT_STRUCT"):
        assert placeholder not in text


@pytest.mark.parametrize("opts", [BlockOptions(key="pointer"), BlockOptions(),
                                  BlockOptions(offsets=OFFSETS, ringbuf_pages=3),
                                  BlockOptions(offsets=OFFSETS, attach="kprobe"),
                                  BlockOptions(offsets=OFFSETS, slot_bits=2)])
def test_render_rejects_bad_options(opts: BlockOptions) -> None:
    with pytest.raises(ValueError):
        render(opts)


@pytest.mark.parametrize(("rwbs", "op"), [("RS", "R"), ("W", "W"), ("FWS", "W"), ("F", "F"),
                                          ("DS", "D"), ("N", "O"), ("", "O")])
def test_op_from_rwbs(rwbs: str, op: str) -> None:
    assert frames.op_from_rwbs(rwbs) == op


def test_struct_offsets_from_a_btf_dump() -> None:
    dump = (
        "[7] STRUCT 'request' size=0 vlen=0\n"  # a forward-declared copy is skipped
        "[8] STRUCT 'request_queue' size=900 vlen=2\n\t'queuedata' type_id=1 bits_offset=0\n"
        "\t'disk' type_id=2 bits_offset=832\n"
        "[9] STRUCT 'request' size=248 vlen=3\n\t'q' type_id=3 bits_offset=0\n"
        "\t'__sector' type_id=4 bits_offset=384\n\t'tag' type_id=5 bits_offset=256\n"
    )
    offsets = btf.struct_offsets(dump, {"request": ("q", "__sector"), "request_queue": ("disk",)})
    assert offsets == {"REQUEST_Q": 0, "REQUEST___SECTOR": 48, "REQUEST_QUEUE_DISK": 104}
    with pytest.raises(btf.BtfError, match="GENDISK_MAJOR"):
        btf.struct_offsets(dump, {"gendisk": ("major",)})


def test_event_dtype_matches_the_c_struct() -> None:
    # 5 u64 + 6 u32 + comm[16] + rwbs[8] = 40 + 24 + 24 bytes, 8-aligned
    assert EVENT_DTYPE.itemsize == 88


def test_block_frame_maps_status_and_drops_untracked() -> None:
    ev = np.zeros(3, dtype=EVENT_DTYPE)
    ev["tracked"] = [1, 0, 1]
    ev["dev"] = (7 << 20) | 3
    ev["issue_ns"], ev["complete_ns"] = [10, 20, 30], [15, 25, 35]
    ev["start_ns"] = [5, 0, 0]
    ev["error"] = [0, 0, -10]  # raw tracepoint: -BLK_STS_IOERR
    ev["rwbs"] = b"R"
    frame = frames.block_frame(ev, "p", from_status=True)
    assert frame["error"].tolist() == [0, -5]
    assert frame["start_ns"].tolist() == [5, -1] and frame["pid"].tolist() == [0, -1]
    assert frame["dev"].tolist() == ["7:3", "7:3"]


def test_depth_series_counts_per_device_and_queue() -> None:
    steps = pd.DataFrame({"ts_ns": [1, 2, 3, 3, 5, 6], "device": ["a", "a", "b", "a", "a", "b"],
                          "hw_queue": -1, "delta": [1, 1, 1, -1, -1, -1]})
    depth = frames.depth_series(steps, "p")
    assert depth["inflight"].tolist() == [1, 2, 1, 1, 0, 0]
    assert depth["device"].tolist() == ["a", "a", "a", "b", "a", "b"]


def test_diskstats_delta() -> None:
    line = "254 0 vda {} 0 {} 0 {} 0 {} 0 {} 7 0\n"
    before = sampler.read_diskstats(line.format(10, 100, 5, 0, 1), ["vda"])
    after = sampler.read_diskstats(line.format(13, 164, 5, 0, 2), ["vda", "sdz"])
    delta = sampler.diskstats_delta(before, after)["vda"]
    assert delta["reads"] == 3 and delta["read_bytes"] == 64 * 512 and delta["in_flight"] == 2


AGG_OFFSETS = {**{name: 8 * i for i, name in enumerate(sorted(aggregate_bpf.OFFSET_NAMES))},
               "REQUEST_START_TIME_NS": 104, "REQUEST_IO_START_TIME_NS": 112}


@pytest.mark.parametrize("track", [False, True])
def test_aggregate_render_attaches_submission_only_when_tracking(track: bool) -> None:
    text = aggregate_bpf.render(aggregate_bpf.AggregateOptions(track=track, offsets=AGG_OFFSETS))
    assert f"#define TRACK {int(track)}" in text
    assert "int agg_block_rq_complete(u64 *ctx)" in text
    assert "#define REQUEST_IO_START_TIME_NS 112" in text
    assert "bpf_probe_read" not in text  # tp_btf: fields are plain loads
    assert "_VALUE" not in text and "EVENT_STRUCT" not in text and "struct event_t {" in text


def test_aggregate_render_rejects_missing_offsets() -> None:
    with pytest.raises(ValueError, match="REQUEST_IO_START_TIME_NS"):
        aggregate_bpf.render(aggregate_bpf.AggregateOptions(offsets=OFFSETS))


def test_aggregate_frames_from_counters() -> None:
    v = np.zeros(aggregate_bpf.NSTATS, dtype="uint64")
    ops, slots = len(aggregate_bpf.OPS), aggregate_bpf.SLOTS
    scalar = {name: i for i, name in enumerate(aggregate_bpf.SCALARS)}
    v[scalar["ios"] * ops + 0], v[scalar["bytes"] * ops + 0] = 3, 3 * 4096  # reads
    v[scalar["service_ns"] * ops + 0] = 600_000
    v[scalar["ios"] * ops + 1], v[scalar["no_issue"] * ops + 1] = 1, 1  # one write, no issue
    service_read = aggregate_bpf.HIST_BASE + (0 * 2 + 1) * slots
    v[service_read + 7], v[service_read + 8] = 2, 1
    counters = aggregate_frames.sum_by_key([(("vda", -1), v), (("vda", -1), v)])
    hist = aggregate_frames.histograms_frame(counters, "p")
    assert hist[["op", "kind", "slot", "lo_us", "hi_us", "count"]].values.tolist() == [
        ["R", "service", 7, 64, 128, 4], ["R", "service", 8, 128, 256, 2]]
    totals = aggregate_frames.totals_frame(counters, "p", window_ns=1_000_000).set_index("op")
    assert totals.loc["R", "ios"] == 6 and totals.loc["R", "bytes"] == 6 * 4096
    assert totals.loc["R", "mean_service_depth"] == pytest.approx(1.2)
    assert totals.loc["W", "no_issue"] == 2 and list(totals.index) == ["R", "W"]
    assert aggregate_frames.slot_bounds_us(1) == (0, 2)
    with pytest.raises(ValueError, match="shape"):
        aggregate_frames.sum_by_key([(("vda", -1), v[:3])])


def test_tracepoint_type_ids_from_a_btf_dump() -> None:
    dump = ("[12] TYPEDEF 'btf_trace_block_rq_completed' type_id=3\n"
            "[28870] TYPEDEF 'btf_trace_block_rq_complete' type_id=12959\n")
    assert btf.tracepoint_type_ids(dump, ("block_rq_complete",)) == {"block_rq_complete": 28870}
    with pytest.raises(btf.BtfError, match="btf_trace_block_io_start"):
        btf.tracepoint_type_ids(dump, ("block_io_start",))


def test_enum_value_from_a_btf_dump() -> None:
    dump = ("[28766] ENUM 'rqf_flags' encoding=UNSIGNED size=4 vlen=2\n"
            "\t'__RQF_STARTED' val=0\n\t'__RQF_FLUSH_SEQ' val=1\n"
            "[28767] ENUM 'other' encoding=UNSIGNED size=4 vlen=1\n\t'__RQF_FLUSH_SEQ' val=9\n")
    assert btf.enum_value(dump, "rqf_flags", "__RQF_FLUSH_SEQ") == 1
    assert btf.enum_value(dump, "rqf_flags", "__RQF_PM") is None
    assert btf.enum_value(dump, "req_flag_bits", "__REQ_FUA") is None


def test_a_request_finished_unissued_is_a_row_without_issue_or_depth() -> None:
    # the flush machinery ends a pre-flush write it never issued: the kernel counts it
    ev = np.zeros(2, dtype=EVENT_DTYPE)
    ev["tracked"], ev["dev"], ev["rwbs"] = 1, (7 << 20) | 3, b"W"
    ev["start_ns"], ev["issue_ns"], ev["complete_ns"] = [5, 6], [0, 10], [40, 30]
    frame = frames.block_frame(ev, "p", from_status=True)
    assert frame["issue_ns"].tolist() == [-1, 10] and frame["insert_ns"].tolist() == [-1, -1]
    steps = frames.block_steps(ev, [], sys_root=Path("/nonexistent"))
    assert sorted(steps["ts_ns"]) == [10, 30]  # only the issued request held the device


def test_log2_histograms_are_bccs_slots_of_tracked_issued_requests() -> None:
    ev = np.zeros(4, dtype=EVENT_DTYPE)
    ev["dev"], ev["tracked"] = 1, [1, 1, 0, 1]
    ev["start_ns"] = [0, 1_000, 1_000, 0]
    ev["issue_ns"] = [1_000, 5_000, 5_000, 0]  # the last one was never issued
    ev["complete_ns"] = [1_500, 13_000, 13_000, 9_000]
    assert frames.log2_histograms(ev) == {"queue_us": {1: {3: 1}},  # 4 us
                                          "service_us": {1: {1: 1, 4: 1}}}  # 0 and 8 us
