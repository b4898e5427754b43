"""What `kvscope demo` will cost, printed before it starts: from a 1 s fp32 GEMM calibration,
the CPU's bf16 support, the study's plan and the machine's load, so a user knows up front
whether the study fits their time (and the demo can be held to what it printed).

Constants fitted on the 2-core AVX2 VM (no AVX-512 / AMX: bf16 linear layers run in fp32
there, patched_backend/vllm_cpu/fp32_gemm.py) and on a bf16-native 2-core VM; see docs/results.md's duration table.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvscope.study import plan
from kvscope.study_options import StudyOptions

SERVER_START_S = 45.0  # vLLM-CPU + LMCache up and healthy (42-53 s measured on a quiet VM)
COLD_PHASE_S = 8.6  # a cold phase's fixed part, and per request / concurrency below (AVX2 VM,
COLD_REQUEST_S = 1.0  # bf16 GEMMs, when a prefill took REFERENCE_PREFILL_S)
COLD_FLOOR = 0.7  # faster compute shrinks the cold phases this far at most (reads, copies stay)
CEILING_S = 6.0  # one ceiling sweep (5 measurements, page cache dropped before each)
TUNE_S = 10.0  # `kvscope.tune: auto` measuring the disk at a server start on stored chunks
ANALYSIS_S = 10.0  # analysing one run (OTLP spans, attribution, plots)
BF16_NATIVE_SPEEDUP = 3.0  # bf16-native CPUs prefill this much faster (1.4 s against 4.5 s)
REFERENCE_PREFILL_S = 13.4  # the AVX2 VM's 1024-token prefill when the cold part was fitted
PREFILL_EFFICIENCY = 0.6  # the twin's prefill rate over the calibration's fp32 GEMM rate (AVX2
# VM: 8.9 CPU-s per 326 GFLOP prefill on 2 cores, ~4.5 s, beside a ~116 GFLOP/s calibration)

def bf16_native(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set(cpuinfo.split())
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def fp32_gflops(seconds: float = 1.0) -> float:
    """A short calibration: this CPU's fp32 GEMM rate (GFLOP/s, all cores). One thread, timed in
    CPU time, the best of the multiplications that fit in `seconds`, times the cores: what the
    CPU can do; other work on the machine stretches wall time, not CPU time (load_factor)."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(1024, 256), torch.randn(256, 3072)
        a @ b
        took: list[float] = []
        started = time.perf_counter()
        while time.perf_counter() - started < seconds or len(took) < 3:
            t = time.process_time()
            a @ b
            took.append(time.process_time() - t)
    finally:
        torch.set_num_threads(threads)
    return 2 * 1024 * 256 * 3072 / max(min(took), 1e-9) / 1e9 * (os.cpu_count() or 1)


def prefill_flops(spec, tokens: int) -> float:
    """FLOPs of one prefill of `tokens` through the twin: its projections and causal attention."""
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_token = spec.hidden_size * (q + 2 * kv) + q * spec.hidden_size \
        + 3 * spec.hidden_size * spec.intermediate_size
    attention = 2 * tokens * tokens * q  # QK^T and PV over the causal half, 2 FLOPs a MAC
    return spec.num_layers * (2 * tokens * per_token + attention)


def estimate(opts: StudyOptions, gflops: float, native: bool) -> dict[str, float]:
    """Seconds per part of the study (after set-up) on an idle machine."""
    from kvscope.capture import twins

    prefill_s = prefill_flops(twins.get(opts.model), opts.prompt_tokens) / (
        gflops * 1e9 * PREFILL_EFFICIENCY)
    if native:
        prefill_s /= BF16_NATIVE_SPEEDUP
    steps = plan(opts)
    warm = sum("warm" in s.phases for s in steps)
    scale = prefill_s / REFERENCE_PREFILL_S if opts.model == "qwen2.5-32b" else 1.0
    cold = len(steps) * sum(COLD_PHASE_S + COLD_REQUEST_S * opts.requests / c
                            for c in opts.concurrency) * min(1.0, max(scale, COLD_FLOOR))
    tuned = sum(_tunes(s.profile) and "warm" not in s.phases for s in steps)
    return {"server starts": len(steps) * SERVER_START_S + tuned * TUNE_S,
            "warm phases": warm * opts.requests * prefill_s,
            "cold phases": cold,
            "ceilings and analysis": len(steps) * (2 * CEILING_S + ANALYSIS_S)}


def _tunes(profile: str) -> bool:
    """Whether the profile's disk tier measures its read knobs when its server starts (on the
    chunks a shared warm phase stored; an empty directory has nothing to measure)."""
    from kvscope.capture.workload import profiles
    from kvscope.patched_backend.parallel_disk.config import PREFIX

    config = profiles.get(profile).lmcache_config(Path("/nonexistent"))
    return (config.get("extra_config") or {}).get(PREFIX + "tune") == "auto"


def load_factor(load: float, cpus: int) -> float:
    """How much other work stretches the study: it gets cpus / (cpus + load) of the cores."""
    return 1.0 + max(load, 0.0) / max(cpus, 1)


def words(opts: StudyOptions, gflops: float, native: bool, load: float, cpus: int) -> str:
    """The line `kvscope demo` prints first: the total at the current load, the idle total and
    its parts, and what the calibration found."""
    parts = estimate(opts, gflops, native)
    idle = sum(parts.values())
    steps = plan(opts)
    warm = sum("warm" in s.phases for s in steps)
    return (f"estimate: {idle * load_factor(load, cpus) / 60:.1f} min after set-up at the "
            f"current load (load average {load:.1f} on {cpus} CPUs), {idle / 60:.1f} min on an "
            "idle machine (" + ", ".join(f"{k} {v / 60:.1f} min" for k, v in parts.items())
            + f"); {len(steps)} runs, {warm} warm phase{'' if warm == 1 else 's'}; "
            f"calibration: fp32 GEMM {gflops:.0f} GFLOP/s, bf16 "
            + ("native" if native else "not native (no AVX512-BF16/AMX): linear layers in "
               "fp32, same products (patched_backend/vllm_cpu/fp32_gemm.py)"))
