"""What `kvscope demo` prints before it starts: parts, bf16 support, the machine's load."""

from __future__ import annotations

import pytest

from kvscope import estimate, study_options


def test_the_estimate_counts_one_warm_phase_per_chunk_format_and_bf16_support(tmp_path):
    from kvscope.capture import twins

    assert estimate.bf16_native("flags : fpu avx2 avx512f avx512_bf16") is True
    assert estimate.bf16_native("flags : fpu avx2 fma") is False
    once = study_options.StudyOptions(out=tmp_path, repeats=1)
    shared = estimate.estimate(once, gflops=50.0, native=False)
    apart = estimate.estimate(study_options.StudyOptions(out=tmp_path, share_warm=False,
                                                         repeats=1), 50.0, False)
    prefill_s = estimate.prefill_flops(twins.get("qwen2.5-32b"), 1024) / (
        50e9 * estimate.PREFILL_EFFICIENCY)
    assert shared["warm phases"] == pytest.approx(16 * prefill_s)
    # every run starts a server; `kvscope` (tune auto) measures the shared warm phase's chunks
    runs = len(study_options.StudyOptions(out=tmp_path).profiles)
    assert shared["server starts"] == pytest.approx(runs * estimate.SERVER_START_S
                                                    + estimate.TUNE_S)
    assert apart["server starts"] == pytest.approx(runs * estimate.SERVER_START_S)  # empty dirs
    profiles = len(study_options.StudyOptions(out=tmp_path).profiles)  # each warms apart
    assert apart["warm phases"] == pytest.approx(profiles * 16 * prefill_s)
    native = estimate.estimate(once, gflops=50.0, native=True)
    assert native["warm phases"] == pytest.approx(shared["warm phases"] / estimate.BF16_NATIVE_SPEEDUP)
    said = estimate.words(once, 50.0, False, load=0.0, cpus=2)
    assert said.startswith("estimate: ") and "1 warm phase;" in said and "not native" in said


def test_each_repetition_starts_every_server_again_and_stock_warms_again(tmp_path):
    """Later repetitions read the first one's stored chunks, but stock keeps its index in its
    server's memory: it warms once per repetition; every kvscope run tunes at its start."""
    once = estimate.estimate(study_options.StudyOptions(out=tmp_path, repeats=1), 50.0, False)
    thrice = estimate.estimate(study_options.StudyOptions(out=tmp_path, repeats=3), 50.0, False)
    assert thrice["warm phases"] == pytest.approx(3 * once["warm phases"])
    for part in ("server starts", "cold phases", "ceilings and analysis"):
        assert thrice[part] == pytest.approx(3 * once[part]), part
    said = estimate.words(study_options.StudyOptions(out=tmp_path), 50.0, False, 0.0, 2)
    runs = 3 * len(study_options.StudyOptions(out=tmp_path).profiles)
    assert f"; {runs} runs, 3 warm phases;" in said


def test_other_work_stretches_the_estimate_by_its_share_of_the_cores(tmp_path):
    opts = study_options.StudyOptions(out=tmp_path)
    idle = sum(estimate.estimate(opts, 100.0, False).values())
    assert estimate.load_factor(0.0, 2) == 1.0 and estimate.load_factor(2.0, 2) == 2.0
    said = estimate.words(opts, 100.0, False, load=1.0, cpus=2)
    assert said.startswith(f"estimate: {idle * 1.5 / 60:.1f} min after set-up at the current "
                           "load (load average 1.0 on 2 CPUs)")
    assert f"{idle / 60:.1f} min on an idle machine" in said
