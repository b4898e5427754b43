"""LMCache's other disk paths on the live stack (tiny twin): each read traced, joined to its
block I/O and attributed like kvscope's backend. One server per peer: raw-block-posix and fs
warm and read cold in their own server; raw-block-io_uring reads the raw-block image cold in a
new server (its index found again on the device)."""

from __future__ import annotations

import pandas as pd
import pytest

from kvscope import analysis, study
from kvscope.analysis import outputs, study_tables
from kvscope.analysis.attribution import COMPONENTS
from kvscope.capture.workload import profiles
from kvscope.contract import rundir
from kvscope.study_options import StudyOptions

pytestmark = [pytest.mark.live, pytest.mark.root]
LABELS = {"raw-block-posix": "lmcache-raw-block-posix",
          "raw-block-io_uring": "lmcache-raw-block-io_uring", "fs": "lmcache-fs"}


def test_live_tiny_peers_are_traced_joined_and_attributed(tmp_path, free_port):
    requests, chunks_per_prompt = 4, 2  # 600-token prompts: two full 256-token chunks each
    opts = StudyOptions(out=tmp_path / "study", model="tiny", profiles=list(profiles.PEERS),
                        requests=requests, concurrency=[2], prompt_tokens=600, port=free_port,
                        kv_dir_base=tmp_path / "kv", repeats=1)
    steps = study.plan(opts)
    assert [s.phases for s in steps] == [["warm", "cold"], ["cold"], ["warm", "cold"]]
    [runs] = study.run_study(opts)
    chunk_bytes = rundir.read_manifest(runs["fs"])["model"]["kv_bytes_per_chunk"]
    assert rundir.read_manifest(runs["raw-block-io_uring"])["study"]["warm_phase_from"] == (
        "raw-block-posix")
    for peer, label in LABELS.items():
        manifest = rundir.read_manifest(runs[peer])
        cold = next(p for p in manifest["phases"] if p["name"] == "cold")
        assert cold["num_errors"] == 0 and cold["page_cache_dropped"], peer
        assert cold["chunks_on_disk"] == requests * chunks_per_prompt, peer
        table = rundir.read_table(runs[peer], "requests")
        assert (table.loc[table["phase"] == "cold", "cached_tokens"] == 512).all(), peer
        spans = analysis.load_run(runs[peer]).spans  # every attribute of a span in one dict
        reads = spans[spans["name"] == "kvscope.storage.read"]
        attrs = list(reads["attributes"])
        cold_reads = [a for a, r in zip(attrs, reads["request_id"]) if "-cold-" in str(r)]
        assert {a["kvscope.storage.backend"] for a in attrs} == {label}, peer
        assert sum(a["kvscope.storage.chunks"] for a in cold_reads) == (
            requests * chunks_per_prompt), peer
        assert sum(a["kvscope.storage.read_bytes"] for a in cold_reads) == (
            requests * chunks_per_prompt * chunk_bytes), peer
        assert all(a["kvscope.storage.reader_tids"] and a["kvscope.storage.failed_chunks"] == 0
                   for a in cold_reads), peer
        attribution = outputs.load_attribution(runs[peer])
        cold_rows = attribution[attribution["phase"] == "cold"]
        parts = sum(cold_rows[f"{c}_ns"].astype("int64") for c in COMPONENTS)
        assert (parts == cold_rows["ttft_ns"].astype("int64")).all(), peer  # exact, to the ns
        assert (cold_rows["read_bytes"] == chunks_per_prompt * chunk_bytes).all(), peer
        assert (cold_rows["block_io_count"] > 0).all(), peer  # the readers' block I/O joined
        assert (cold_rows["storage_read_ns"].astype("int64") > 0).all(), peer
        ledger = pd.read_parquet(runs[peer] / "chunk_ledger.parquet")
        looked = ledger[ledger["request_id"].isin(cold_rows["request_id"])]
        assert set(looked["request_id"]) == set(cold_rows["request_id"]), peer
        assert (looked["tier"] == "disk").all(), (peer, looked["tier"].value_counts())
    table = study_tables.headline(runs)
    assert set(table["bound"]) <= {study_tables.DEVICE_BOUND, study_tables.READ_PATH_BOUND,
                                   study_tables.CPU_BOUND}
