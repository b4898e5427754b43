"""The demo's study tables: headline per profile and cold phase, verdict, report."""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from kvscope.contract.env import ENV_FP32_GEMM
from kvscope.analysis import (outputs, replicates, study_peers, study_repeats, study_report,
                              study_tables, study_targets, study_verdict)
from kvscope.testkit import synthetic
from kvscope import study, study_options
from kvscope.contract import ceiling, rundir, study_roles


def describe(run) -> None:
    """What `kvscope run` records about the model, workload and machine."""
    rundir.update_manifest(run, "model", {"twin": "tiny", "kv_bytes_per_token": 1024,
                                          "kv_bytes_per_chunk": 262144})
    rundir.update_manifest(run, "workload", {"num_requests": 40, "prompt_tokens": 600,
                                             "concurrency": [4]})
    rundir.update_manifest(run, "machine", {"hostname": "h", "cpus": 2, "disk_device": "vda"})


def study_md(study_dir, runs, table) -> str:
    """study.md as `kvscope demo` writes it, of one repetition: each profile's warm group from
    the study."""
    groups = {profile: study.warm_group(profile) for profile in runs}
    summary = study_repeats.replicated([runs])
    return study_report.write_report(study_dir, [runs], table, summary, groups).read_text()


def made(steps, runs, after=None) -> list:
    """What run_study hands to record: each step with its run and the ceiling measured after."""
    return [(s, runs[s.profile], (after or {}).get(s.profile)) for s in steps]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("study")
    made = {}
    for seed, profile in enumerate((study_roles.BASELINE, study_roles.CANDIDATE)):
        run = synthetic.make_run(base / profile, n_requests=40, seed=seed, phases=("cold",))
        rundir.update_manifest(run, "device_ceiling", {"bytes_per_s": 4e9})
        describe(run)
        outputs.analyze(run, plots=False)
        made[profile] = run
    return made


def test_headline_has_one_row_per_profile_and_cold_phase(runs):
    table = study_tables.headline(runs)
    assert sorted(table["profile"]) == sorted(runs)
    assert (table["ceiling_GBps"] == 4.0).all()
    serial = table[table["profile"] == study_roles.BASELINE].iloc[0]
    parallel = table[table["profile"] == study_roles.CANDIDATE].iloc[0]
    assert serial["speedup_vs_serial"] == 1.0
    assert parallel["speedup_vs_serial"] == pytest.approx(
        serial["ttft_p50_s"] / parallel["ttft_p50_s"])
    assert 0 < parallel["disk_busy_share"] <= 1
    assert math.isclose(parallel["read_vs_ceiling"], parallel["read_GBps"] / 4.0)


def test_verdict_and_report_name_the_limit(runs, tmp_path):
    table = study_tables.headline(runs)
    lines = study_verdict.verdict(table)
    assert len(lines) == 1 and lines[0].startswith("c=")
    report = study_md(tmp_path, runs, table)
    assert "## Headline" in report and "## Every ratio, across repetitions" in report
    assert "One repetition of each profile" in report
    [said] = study_verdict.verdict(table, runs, study_repeats.replicated([runs]))
    assert "x (unknown spread: one repetition), throughput" in said
    assert said.startswith(lines[0].split(";")[0]) and said in report
    [thrice] = study_verdict.verdict(table, runs, study_repeats.replicated([runs] * 3))
    assert "across 3 repetitions), throughput" in thrice


def _ceiling(rate: float, when: str = "before the first cold phase") -> dict:
    return {"bytes_per_s": rate, "bytes": 1 << 30, "seconds": (1 << 30) / rate, "files": 16,
            "unit": 4 << 20, "depth": 32, "method": ceiling.RAW_METHOD, "when": when}


@pytest.fixture()
def three_runs(tmp_path):
    """Three synthetic runs on one disk whose own ceilings differ (as the issue's 3.21, 4.14
    and 4.44 GB/s), one measured again after its last cold phase."""
    made = {}
    for seed, (profile, rate) in enumerate(((study_roles.BASELINE, 3.21e9), (study_roles.CANDIDATE, 4.14e9),
                                            ("stock", 4.44e9))):
        run = synthetic.make_run(tmp_path / profile, n_requests=24, seed=seed, phases=("cold",))
        rundir.update_manifest(run, "device_ceiling", _ceiling(rate))
        describe(run)
        made[profile] = run
    return made


def test_a_study_has_one_ceiling_per_disk_the_best_of_every_measurement(three_runs, tmp_path):
    after = {"stock": ceiling.best_of([_ceiling(4.5e9, "after the last cold phase")])}
    opts = study_options.StudyOptions(out=tmp_path, profiles=list(three_runs), repeats=1)
    body = study.record(opts, made(study.plan(opts), three_runs, after))
    best = body["device_ceilings"]["vda"]
    assert best["bytes_per_s"] == 4.5e9 and best["when"] == "after the last cold phase"
    assert sorted(s["bytes_per_s"] for s in best["samples"]) == [3.21e9, 4.14e9, 4.44e9, 4.5e9]
    assert best["spread"] == pytest.approx((4.5 - 3.21) / 4.5)
    for run in three_runs.values():
        outputs.analyze(run, plots=False)
        assert rundir.read_manifest(run)["study"]["device_ceiling"]["bytes_per_s"] == 4.5e9
    table = study_tables.headline(three_runs)
    assert (table["ceiling_GBps"] == 4.5).all()
    lines = study_report.ceiling_lines(three_runs)
    assert len(lines) == 1 and "best of 4 measurements" in lines[0] and "spread 29%" in lines[0]
    other = ceiling.best_of([best, {**_ceiling(1e9), "unit": 1 << 20, "depth": 16}])
    assert other.bytes_per_s == 4.5e9 and other.spread == pytest.approx((4.5 - 3.21) / 4.5)


def test_the_disk_read_with_every_cpu_busy_scales_the_ceiling_into_a_second_bar(three_runs,
                                                                                 tmp_path):
    opts = study_options.StudyOptions(out=tmp_path, profiles=list(three_runs), repeats=1)
    steps = study.plan(opts)
    busy = {"unit": 4 << 20, "depth": 32, "busy_cpus": 2, "idle_bytes_per_s": 4e9,
            "busy_bytes_per_s": 2e9, "ratio": 0.5, "idle_samples": [4e9], "busy_samples": [2e9]}
    body = study.record(opts, made(steps, three_runs), busy)
    assert body["device_busy_ratios"] == {"vda": busy}
    for run in three_runs.values():
        assert rundir.read_manifest(run)["study"]["device_busy_ratio"] == busy
        outputs.analyze(run, plots=False)
    table = study_tables.headline(three_runs)
    expected = (table["read_GBps"] / (table["ceiling_GBps"] * 0.5)).clip(upper=1.0)
    assert table["read_vs_busy_ceiling"].to_numpy() == pytest.approx(expected.to_numpy())
    assert (table["read_vs_busy_ceiling"] > table["read_vs_ceiling"]).all()
    study.record(opts, made(steps, three_runs))  # no busy measurement: no second bar
    assert study_tables.headline(three_runs)["read_vs_busy_ceiling"].isna().all()


def test_a_phase_faster_than_the_ceiling_says_under_measured_never_above_100(three_runs, tmp_path):
    opts = study_options.StudyOptions(out=tmp_path, profiles=list(three_runs), repeats=1)
    study.record(opts, made(study.plan(opts), three_runs))
    for run in three_runs.values():
        rundir.update_manifest(run, "study", {
            **rundir.read_manifest(run)["study"], "device_ceiling": _ceiling(1e6)})
        summary = outputs.analyze(run, plots=False)[1]
        assert "device-saturated" not in {f["id"] for f in summary["findings"]}
    table = study_tables.headline(three_runs)
    assert (table["read_vs_ceiling"] == 1.0).all() and (table["ceiling_under_by"] > 0).all()
    line = study_verdict.verdict(table)[0]
    assert "the ceiling was under-measured by at least" in line
    report = study_md(tmp_path, three_runs, table)
    said = re.sub(r"under-measured by at least \d+ ?%", "", report.split("## What limits")[1])
    percents = [int(p) for p in re.findall(r"(\d+) ?%", said)]
    assert percents and max(percents) <= 100, said


def test_the_stock_run_warms_for_the_whole_study(tmp_path):
    opts = study_options.StudyOptions(out=tmp_path / "s", kv_dir_base=tmp_path / "kv", repeats=1)
    steps = study.plan(opts)
    assert [s.profile for s in steps] == ["stock", study_roles.BASELINE, study_roles.CLASSIC,
                                          study_roles.CANDIDATE, "raw-block-posix",
                                          "raw-block-io_uring", "fs"]
    stock, serial, classic, parallel, posix, uring, fs = steps
    kvscope = (serial, classic, parallel)
    assert stock.phases == ["warm", "cold"] and stock.warm_from is None
    assert stock.copy_dir is not None and stock.copy_dir != stock.kv_dir
    for step in kvscope:  # cold only, each in its own server, on the copy
        assert step.phases == ["cold"] and step.warm_from == "stock"
        assert step.kv_dir == stock.copy_dir and step.copy_dir is None
    # each peer format is written once by stock's server, read cold in a server of its own
    assert set(stock.peer_copies) == {"raw-block", "fs"}
    assert posix.kv_dir == uring.kv_dir == stock.peer_copies["raw-block"]
    assert fs.kv_dir == stock.peer_copies["fs"]
    for step in (posix, uring, fs):
        assert step.phases == ["cold"] and step.warm_from == "stock" and not step.peer_copies
    assert len({stock.kv_dir, stock.copy_dir, *stock.peer_copies.values()}) == 4
    assert study.warm_group("stock") is None
    assert (study.warm_group(study_roles.BASELINE) == study.warm_group(study_roles.CLASSIC)
            == study.warm_group(study_roles.CANDIDATE) is not None)
    apart = study.plan(study_options.StudyOptions(out=tmp_path / "s", share_warm=False,
                                                  repeats=1))
    assert all(s.phases == ["warm", "cold"] and s.copy_dir is None for s in apart)
    assert [s.profile for s in apart] == opts.profiles


def test_without_a_stock_profile_the_first_of_a_chunk_format_warms(tmp_path):
    opts = study_options.StudyOptions(out=tmp_path / "s", kv_dir_base=tmp_path / "kv",
                              profiles=[study_roles.BASELINE, study_roles.CANDIDATE], repeats=1)
    serial, parallel = study.plan(opts)
    assert serial.phases == ["warm", "cold"] and serial.copy_dir is None
    assert parallel.phases == ["cold"] and parallel.warm_from == study_roles.BASELINE
    assert parallel.kv_dir == serial.kv_dir


def test_the_copy_tier_is_write_only_and_after_stocks_own(tmp_path):
    from kvscope.capture.workload import profiles

    config = profiles.with_kvscope_copy(profiles.get("stock").lmcache_config(tmp_path / "a"),
                                        tmp_path / "b")
    assert config["local_disk"] == f"file://{tmp_path / 'a'}"
    assert config["storage_plugins"] == ["kvscope"]
    extra = config["extra_config"]
    assert extra["kvscope.path"] == str(tmp_path / "b") and extra["kvscope.write_only"] is True
    with pytest.raises(ValueError):
        profiles.with_kvscope_copy(profiles.get(study_roles.BASELINE).lmcache_config(tmp_path), tmp_path)


def test_headline_throughput_columns_are_the_phase_rates(runs):
    table = study_tables.headline(runs).set_index("profile")
    for profile, run in runs.items():
        requests = rundir.read_table(run, "requests")
        ok = requests[requests["status"] == "ok"]
        wall_s = (ok["finish_ns"].max() - ok["arrival_ns"].min()) / 1e9
        assert table.loc[profile, "req_per_s"] == pytest.approx(len(ok) / wall_s, rel=1e-12)
        assert table.loc[profile, "out_tok_per_s"] == pytest.approx(
            ok["output_tokens"].clip(lower=0).sum() / wall_s, rel=1e-12)
    rates = study_repeats.ratio_rows(runs, rep=1).set_index("metric")
    r = rates.loc["requests_per_s"]
    assert r["ratio"] == pytest.approx(table.loc[study_roles.CANDIDATE, "req_per_s"]
                                       / table.loc[study_roles.BASELINE, "req_per_s"])
    assert table.loc[study_roles.CANDIDATE, "throughput_vs_serial"] == pytest.approx(r["ratio"])
    assert r["run_lo"] <= r["ratio"] <= r["run_hi"]


@pytest.mark.live
@pytest.mark.root
def test_live_tiny_study_shares_one_warm_phase_and_still_reads_every_chunk_cold(tmp_path,
                                                                               free_port):
    """stock warms (its server also stores kvscope's format, write-only); kvscope-serial, a new
    server on those files, runs cold only. Both cold phases read every full chunk back from the
    disk (page cache dropped first), stock's through its own tier only."""
    import pandas as pd

    requests, prompt_tokens, chunks_per_prompt = 4, 600, 2  # two full 256-token chunks each
    opts = study_options.StudyOptions(out=tmp_path / "study", model="tiny",
                              profiles=[study_roles.BASELINE, "stock"], requests=requests,
                              concurrency=[2], prompt_tokens=prompt_tokens, port=free_port,
                              kv_dir_base=tmp_path / "kv", repeats=1)
    [runs] = study.run_study(opts)
    assert list(runs) == [study_roles.BASELINE, "stock"]  # the order asked for, not the run order
    from kvscope.patched_backend.vllm_cpu import fp32_gemm

    for run in runs.values():  # bf16 layers in fp32 exactly where oneDNN has no bf16 matmul
        assert rundir.read_manifest(run)["server"]["env"][ENV_FP32_GEMM] == "1"
        applied = "bf16 linear layers compute in fp32" in (run / "server.log").read_text()
        assert applied == fp32_gemm.onednn_lacks_bf16()
    serial, stock = (rundir.read_manifest(runs[p]) for p in (study_roles.BASELINE, "stock"))
    assert [p["name"] for p in stock["phases"]] == ["warm", "cold"]
    assert [p["name"] for p in serial["phases"]] == ["cold"]  # no warm phase of its own
    assert serial["study"]["warm_phase_from"] == "stock"
    assert stock["study"]["warm_phase_from"] is None
    assert stock["copy"]["chunks_on_disk"] == requests * chunks_per_prompt
    assert stock["backend"]["lmcache"]["extra_config"]["kvscope.write_only"] is True
    chunk_bytes = serial["model"]["kv_bytes_per_chunk"]
    for profile, run in runs.items():
        manifest = rundir.read_manifest(run)
        cold = next(p for p in manifest["phases"] if p["name"] == "cold")
        assert cold["page_cache_dropped"] and cold["num_errors"] == 0
        assert cold["chunks_on_disk"] == requests * chunks_per_prompt
        assert cold["disk_read_bytes"] >= requests * chunks_per_prompt * chunk_bytes, profile
        table = rundir.read_table(run, "requests")
        assert (table.loc[table["phase"] == "cold", "cached_tokens"] == 512).all(), profile
        io = rundir.read_table(run, "block_io")
        cold_reads = io[(io["phase"] == "cold") & (io["op"] == "R")]
        assert cold_reads["bytes"].sum() >= requests * chunks_per_prompt * chunk_bytes, profile
    spans = pd.read_parquet(runs["stock"] / "spans.parquet")
    reads = [json.loads(a) for a in spans.loc[spans["name"] == "kvscope.storage.read",
                                              "attributes"]]
    assert {r["kvscope.storage.backend"] for r in reads} == {"lmcache-local-disk"}
    assert sum(r["kvscope.storage.chunks"] for r in reads) == requests * chunks_per_prompt
    ceilings = json.loads((opts.out / "study.json").read_text())["device_ceilings"]
    assert len(ceilings) == 1
    [best] = ceilings.values()
    assert serial["study"]["device_ceiling"] == stock["study"]["device_ceiling"] == best
    assert {s["when"] for s in best["samples"]} == {"before the first cold phase",
                                                    "after the last cold phase"}
    assert not (tmp_path / "kv").exists() or not any((tmp_path / "kv").iterdir())
    table = study_tables.headline(runs)
    assert (table["req_per_s"] > 0).all() and (table["storage_tok_per_s"] > 0).all()


def test_peer_formats_are_written_by_tiers_after_stocks_own(tmp_path):
    from kvscope.capture.workload import peers, profiles

    for made in ("rb", "fs"):  # the runner makes them (private, locked) before the server
        (tmp_path / made).mkdir()
    config = peers.with_copies(profiles.get("stock").lmcache_config(tmp_path / "a"),
                               {"raw-block": tmp_path / "rb", "fs": tmp_path / "fs"})
    assert config["local_disk"] == f"file://{tmp_path / 'a'}"  # stock's tier, asked first
    assert config["storage_plugins"] == [peers.RAW_BLOCK_PLUGIN]
    assert config["remote_storage_plugins"] == [peers.FS_PLUGIN]
    extra = config["extra_config"]
    image = tmp_path / "rb" / peers.IMAGE
    assert extra["rust_raw_block.device_path"] == str(image)
    assert extra["rust_raw_block.use_odirect"] is True
    assert extra[f"remote_storage_plugin.{peers.FS_PLUGIN}.base_path"] == str(tmp_path / "fs")
    assert extra["fs_connector_use_odirect"] is True and extra["save_chunk_meta"] is False
    assert image.stat().st_size == peers.IMAGE_BYTES and peers.allocated_bytes(image) < 1 << 20
    uring = profiles.get("raw-block-io_uring").lmcache_config(tmp_path / "rb")["extra_config"]
    assert uring["rust_raw_block.io_engine"] == "io_uring"
    assert uring["rust_raw_block.device_path"] == str(image)  # one image, both engines
    assert study.warm_group("raw-block-posix") == study.warm_group("raw-block-io_uring")


def test_peer_verdicts_follow_the_rule_across_repetitions_and_name_what_to_shrink(runs):
    """One repetition: no standing claimed. The same pair of runs three times: no spread, so
    the interval is the ratio itself and the standing is its side of 1."""
    table = study_tables.headline(runs)
    once = study_repeats.replicated([runs])
    [line] = study_peers.peer_verdicts(table, once)
    assert "kvscope of unknown standing (one repetition" in line and "to pass it" not in line
    thrice = study_repeats.replicated([runs, runs, runs])
    row = thrice.set_index(["against", "metric"]).loc[(study_roles.BASELINE, "ttft")]
    p50 = table.set_index("profile")["ttft_p50_s"]
    assert row["ratio"] == pytest.approx(p50[study_roles.BASELINE] / p50[study_roles.CANDIDATE],
                                         rel=1e-6)
    assert row["reps"] == 3 and row["rep_lo"] == pytest.approx(row["rep_hi"])
    [line] = study_peers.peer_verdicts(table, thrice)
    standing = "ahead" if row["ratio"] > 1 else "behind"
    assert f"kvscope {standing}" in line and "across 3 repetitions" in line
    assert ("to pass it" in line) == (standing == "behind")
    assert study_tables.bound(table.iloc[0]) in line


def test_each_missed_target_says_why_from_the_runs_own_analysis(tmp_path):
    """The targets table names which target a row missed; the reason lines say why, in the
    run's own figures (its read_path row and the p50s of its TTFT parts), and only for what
    it missed."""
    runs = {}
    for seed, profile in enumerate((study_roles.CLASSIC, study_roles.CANDIDATE)):
        run = synthetic.make_run(tmp_path / profile, n_requests=32, seed=seed, concurrency=8,
                                 phases=("cold-c8",))
        rundir.update_manifest(run, "device_ceiling", {"bytes_per_s": 4e9})
        describe(run)
        outputs.analyze(run, plots=False)
        runs[profile] = run
    table = study_tables.headline(runs)
    targets = study_targets.target_rows(runs, table)
    assert sorted(targets["profile"]) == sorted(runs) and (targets["phase"] == "cold-c8").all()
    lines = study_targets.target_reasons(runs, targets)
    for row, line in zip(targets.to_dict("records"), lines):
        summary = json.loads((runs[row["profile"]] / "summary.json").read_text())
        reads = next(r for r in summary["read_path"] if r["phase"] == "cold-c8")
        assert line.startswith(f"{row['profile']} c=8: ")
        missed_read = "x the ceiling while reading" in line
        missed_busy = ": the disk was idle" in line
        missed_ttft = "x the floor (" in line
        assert missed_read == (row["read_vs_ceiling"] < study_targets.TARGET_READ)
        assert missed_busy == (row["disk_busy_share"] < study_targets.TARGET_BUSY)
        assert missed_ttft == (row["ttft_vs_floor"] > study_targets.TARGET_TTFT)
        if missed_busy:
            assert f"idle {reads['idle_s']:.2f} s of the {reads['read_span_s']:.2f} s" in line
            assert f"{reads['idle_unasked_s']:.2f} s of it with no request waiting" in line
        if missed_ttft:
            p50 = outputs.load_attribution(runs[row["profile"]])["transfer_ns"].median() / 1e9
            assert f"transfer {p50:.2f} s" in line
    report = study_md(tmp_path, runs, table)
    assert all(f"- {line}" in report for line in lines)


def test_a_stray_read_of_another_thread_does_not_stretch_the_read_span(tmp_path):
    """One block read by a thread that is not a reader (another process, a page-in), 3 s after
    the phase's last read: the headline's busy share and read rate stay those of the read
    path's own reads, where counting every block read would have stretched the span."""
    run = synthetic.make_run(tmp_path / study_roles.CANDIDATE, n_requests=16, seed=3,
                             concurrency=4, phases=("cold-c4",))
    rundir.update_manifest(run, "device_ceiling", {"bytes_per_s": 4e9})
    describe(run)
    io = rundir.read_table(run, "block_io")
    stray = io[io["op"] == "R"].tail(1).astype({c: str for c in io.select_dtypes("category").columns}).assign(
        tid=io["tid"].max() + 1000, start_ns=io["complete_ns"].max() + 3_000_000_000,
        issue_ns=io["complete_ns"].max() + 3_000_000_000,
        complete_ns=io["complete_ns"].max() + 3_001_000_000)
    rundir.append_table(run, "block_io", stray)
    outputs.analyze(run, plots=False)
    summary = json.loads((run / "summary.json").read_text())
    own = next(r for r in summary["read_path"] if r["phase"] == "cold-c4")
    every = next(r for r in summary["read_bandwidth"] if r["phase"] == "cold-c4")
    assert every["wall_s"] > own["read_span_s"] + 2.9  # the stray stretched the phase's span
    row = study_tables.headline({study_roles.CANDIDATE: run}).iloc[0]
    assert row["disk_busy_share"] == pytest.approx(own["busy_s"] / own["read_span_s"])
    assert row["read_GBps"] == pytest.approx(own["busy_bytes_per_s"] / 1e9)


def _positions(blocks: list[list[str]]) -> dict[str, float]:
    """Each profile's mean position within its blocks."""
    return {p: sum(block.index(p) for block in blocks) / len(blocks) for p in blocks[0]}


def test_abba_blocks_run_every_profile_once_each_and_balance_their_positions():
    first = ["stock", "kvscope-serial", "kvscope"]
    blocks = study.block_orders(first, 4, "abba", random.Random(0))
    assert blocks == [first, first[::-1], first, first[::-1]]
    assert all(sorted(block) == sorted(first) for block in blocks)
    assert set(_positions(blocks).values()) == {1.0}  # an even count: every mean in the middle
    assert study.block_orders(first, 1, "abba", random.Random(0)) == [first]


def test_random_blocks_are_permutations_drawn_from_the_seed():
    first = ["stock", "kvscope-serial", "kvscope", "fs", "raw-block-posix"]
    blocks = study.block_orders(first, 6, "random", random.Random(7))
    assert blocks[0] == first and all(sorted(b) == sorted(first) for b in blocks)
    assert blocks == study.block_orders(first, 6, "random", random.Random(7))
    assert blocks != study.block_orders(first, 6, "random", random.Random(8))
    with pytest.raises(ValueError, match="order must be one of"):
        study.block_orders(first, 2, "latin", random.Random(0))
    with pytest.raises(ValueError, match="repeats at least 1"):
        study.block_orders(first, 0, "abba", random.Random(0))


@pytest.mark.parametrize("order", ["abba", "random"])
def test_repetitions_reread_the_first_blocks_chunks_and_stock_warms_each_time(tmp_path, order):
    opts = study_options.StudyOptions(out=tmp_path / "s", kv_dir_base=tmp_path / "kv",
                                      repeats=3, order=order, seed=3)
    steps = study.plan(opts)
    first = study.plan(study_options.StudyOptions(
        out=tmp_path / "s", kv_dir_base=tmp_path / "kv", repeats=1, order=order, seed=3))
    assert steps[:len(first)] == first and steps[0].profile == "stock"
    assert len(steps) == 3 * len(opts.profiles)
    for profile in opts.profiles:
        assert [s.rep for s in steps if s.profile == profile] == [1, 2, 3]
    reads = {s.profile: s for s in first}
    for step in steps[len(first):]:
        if step.profile == "stock":  # its index lives in memory: a new warm phase, own dir
            assert step.phases == ["warm", "cold"] and step.warm_from is None
            assert step.kv_dir == tmp_path / "kv" / f"kv-stock-r{step.rep}"
        else:  # the same stored files, cold only
            assert step.phases == ["cold"] and step.kv_dir == reads[step.profile].kv_dir
            assert step.warm_from == "stock"
        assert step.copy_dir is None and not step.peer_copies
    assert len({s.name for s in steps}) == len(steps)
    if order == "random":
        assert steps == study.plan(opts)  # the seed fixes it


def test_without_stock_the_profile_that_stored_the_chunks_rereads_them(tmp_path):
    opts = study_options.StudyOptions(out=tmp_path / "s", kv_dir_base=tmp_path / "kv",
                                      profiles=[study_roles.BASELINE, study_roles.CANDIDATE],
                                      repeats=2)
    serial, parallel, parallel2, serial2 = study.plan(opts)  # A B, then B A
    assert serial.phases == ["warm", "cold"] and (parallel2.rep, serial2.rep) == (2, 2)
    assert serial2.phases == parallel2.phases == ["cold"]
    assert serial2.kv_dir == parallel2.kv_dir == serial.kv_dir
    assert serial2.warm_from == study_roles.BASELINE


def test_the_order_each_run_ran_in_is_recorded(three_runs, tmp_path):
    opts = study_options.StudyOptions(out=tmp_path, profiles=list(three_runs), repeats=2,
                                      order="random", seed=11)
    steps = study.plan(opts)
    runs = {(s.profile, s.rep): three_runs[s.profile] for s in steps}
    body = study.record(opts, [(s, runs[(s.profile, s.rep)], None) for s in steps])
    written = json.loads((tmp_path / "study.json").read_text())
    assert written == json.loads(json.dumps(body))
    assert (written["repetitions"], written["order"], written["seed"]) == (2, "random", 11)
    assert [(r["profile"], r["repetition"]) for r in written["run_order"]] == [
        (s.profile, s.rep) for s in steps]
    assert [list(r) for r in written["runs"]] == [list(three_runs)] * 2  # the order asked for
    last = steps[-1]
    section = rundir.read_manifest(three_runs[last.profile])["study"]
    assert (section["repetition"], section["repetitions"], section["position"]) == (
        2, 2, len(steps) - 1)


def test_the_headline_over_repetitions_takes_medians_and_the_ratios_geometric_mean(runs,
                                                                                  tmp_path):
    once = study_tables.headline(runs)
    table = study_repeats.pooled_headline([runs, runs])
    assert list(table.columns) == [*once.columns, "reps"] and (table["reps"] == 2).all()
    numeric = once.select_dtypes("number").columns
    assert table[numeric].to_numpy() == pytest.approx(once[numeric].to_numpy(), nan_ok=True)
    assert list(table["bound"]) == list(once["bound"])
    summary = study_repeats.replicated([runs, runs, runs])
    report = study_report.write_report(tmp_path, [runs] * 3, table, summary,
                                       {p: study.warm_group(p) for p in runs}).read_text()
    assert "3 repetitions of each profile" in report
    assert not (summary["standing"] == replicates.UNKNOWN).any()
    for line in study_repeats.lines(summary):
        assert f"- {line}" in report and "across 3 repetitions" in line


def test_the_demos_headline_names_no_winner_from_one_repetition(runs, capsys):
    """What `kvscope demo` prints after the runs: with one repetition every comparison says
    its spread is unknown; with three (the same runs: no spread) each says where it stands."""
    from kvscope.commands import demo

    for reps, said in (([runs], "TTFT p50 unknown spread (one repetition: no winner claimed"),
                       ([runs] * 3, "95 % interval across 3 repetitions")):
        demo._print_findings(reps, study_repeats.pooled_headline(reps),
                             study_repeats.replicated(reps))
        out = capsys.readouterr().out
        [line] = [x for x in out.splitlines() if x.startswith(f"`{study_roles.CANDIDATE}` against")]
        assert said in line, line
    assert ("TTFT p50 faster" in line) or ("TTFT p50 slower" in line)
