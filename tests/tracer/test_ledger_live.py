"""The chunk ledger on a user's server (tiny twin, `python -m vllm.entrypoints.openai.api_server`),
every reason made on purpose, with exact token counts; two servers in all.

Server A, the kvscope disk tier alone (capacity: five chunk files) on a small tmpfs: a
first-time prompt (never stored; LMCache looks up full chunks only, so its 88-token tail is in
no row), the same again (disk hits), a prompt sharing only the first chunk (diverged at token
256), a chunk whose file is damaged on disk (refused: checksum), a store while the file system
is full (ENOSPC), then a prompt of five chunks that evicts all older ones (evicted by the
capacity).
Server B, LMCache's CPU tier (eight chunks) with the disk tier second (room for all), the
file system full at first: hits from the CPU tier, then the CPU tier evicts a prompt whose disk writes failed
(evicted from the CPU tier, no disk copy) and one the disk tier holds (disk hits).
Each request's ledger is read from the spans its worker wrote, and nothing is reported for a
chunk that hit; server A's spans are also imported and analysed with the CLI (`kvscope import`,
`kvscope analyze`), whose printed tiers and reasons are checked. The per-reason table is
printed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
from kvscope.testkit.tracing import wait_until
from kvscope.testkit.user_server import complete, tiny_prompts, user_server

from kvscope.capture import twins
from kvscope.analysis import ledger as analysis_ledger
from kvscope.analysis.otlp import read_span_files
from kvscope.contract import chunk_outcomes
from kvscope.patched_backend.parallel_disk.chunkfile import HEADER_SIZE, SUFFIX, file_size_for
from kvscope.patched_backend.parallel_disk.lmcache_config import lmcache_settings
from kvscope.tracer.run import summarize_stats, wait_for_span_files
from kvscope.capture.workload import profiles

pytestmark = [pytest.mark.live, pytest.mark.root]
CHUNK = 256
TAIL = 88  # every prompt ends in 88 tokens past its last full chunk: never looked up
SPEC = twins.get("tiny")
CHUNK_BYTES = 2 * SPEC.num_layers * CHUNK * SPEC.num_kv_heads * SPEC.head_dim * 2  # bf16 K+V
FILE = file_size_for(CHUNK_BYTES)
ENOSPC_LINE = re.compile(r"store of \S+ skipped: ENOSPC")


def _fill(mnt: Path) -> Path:
    """Fill the file system but for less than one chunk file; the filler's path."""
    st = os.statvfs(mnt)
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - FILE // 4))
    return filler


def _profile(name: str, kv: Path, files: int, **config) -> str:
    """A test profile (user_server takes one by name) on `kv`, capacity `files` chunk files."""
    def build(_ignored: Path) -> dict:
        settings = lmcache_settings(kv, capacity=str(files * FILE), hugepages=False)
        return {**settings, **config}

    profiles.register(profiles.Profile(name, "chunk-ledger live test", build))
    return name


def _chunks(kv: Path) -> int:
    return len(list(kv.glob(f"*{SUFFIX}"))) if kv.exists() else 0


def _wait_files(kv: Path, count: int) -> None:
    assert wait_until(lambda: _chunks(kv) >= count, timeout_s=60), (_chunks(kv), count)
    time.sleep(0.3)


def _ask(server, name: str, prompt: list[int]) -> None:
    complete(server, prompt, max_tokens=1, headers={"X-Request-Id": name})


def _no_kvscope_errors(spans_dir: Path, log: Path) -> None:
    """The ledger's wrappers and listener raised nothing (counted per hook, logged once)."""
    stats = summarize_stats(spans_dir, final=True)
    assert stats["processes"] >= 2 and stats["hook_errors"] == {}, stats["hook_errors"]
    assert "kvscope tracer (pid" not in log.read_text()


def _ledger(spans_dir: Path) -> pd.DataFrame:
    spans, problems = read_span_files(sorted(spans_dir.glob("*.json")), 0)
    assert not problems, problems
    return analysis_ledger.table(spans)


def _wait_ledger(spans_dir: Path, last: str) -> None:
    """Until the worker's span files hold the last request's ledger (exports are periodic)."""
    assert wait_until(lambda: last in set(_ledger(spans_dir)["request_id"]), timeout_s=60,
                      step_s=0.5), last
    wait_for_span_files(spans_dir)


def _outcomes(table: pd.DataFrame) -> dict[str, Counter]:
    """request -> Counter of tokens per `hit:<tier>` / miss reason."""
    out: dict[str, Counter] = {}
    for row in table.itertuples(index=False):
        label = f"hit:{row.tier}" if row.tier != chunk_outcomes.TIER_NONE else row.reason
        out.setdefault(row.request_id, Counter())[label] += row.tokens
    return out


def _print_table(title: str, table: pd.DataFrame) -> None:
    misses = table[table["tier"] == chunk_outcomes.TIER_NONE]
    hits = table[table["tier"] != chunk_outcomes.TIER_NONE]
    rows = [(f"hit:{t}", len(g), int(g["tokens"].sum())) for t, g in hits.groupby("tier")]
    rows += [(r, len(g), int(g["tokens"].sum())) for r, g in misses.groupby("reason")]
    print(f"\n{title}\n| tier / reason | chunks | tokens |\n|---|---|---|")
    for label, chunks, tokens in rows:
        print(f"| {label} | {chunks} | {tokens} |")


def _analyze(spans_dir: Path, run: Path) -> str:
    """`kvscope import` the server's span files (not its stats/), then `kvscope analyze`, as a
    user would; what analyze printed."""
    traces = run.with_name(f"{run.name}-traces")
    traces.mkdir()
    for path in spans_dir.glob("*.json"):
        shutil.copy(path, traces)
    for argv in (["import", str(traces), "--out", str(run)], ["analyze", str(run),
                                                               "--no-plots"]):
        proc = subprocess.run([sys.executable, "-m", "kvscope.cli", *argv], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _check(table: pd.DataFrame, expected: dict[str, dict[str, int]]) -> None:
    hits = table[table["tier"] != chunk_outcomes.TIER_NONE]
    assert (hits["reason"] == "").all() and (hits["detail"].isin(["", "kvscope"])).all()
    got = _outcomes(table)
    for rid, want in expected.items():
        assert dict(got.get(rid, {})) == want, (rid, dict(got.get(rid, {})), want)


def test_every_miss_reason_of_the_disk_tier(tmp_path, tmpfs):
    """Server A, the kvscope disk tier alone (capacity 5 chunk files): never stored, disk hits,
    diverged, refused, ENOSPC, evicted by capacity."""
    tmpfs = tmpfs("4m")  # the KV directory (room for ~15 chunk files), filled on demand
    a_prompts = tiny_prompts(6, 2 * CHUNK + TAIL, seed=120)
    p1, other, p3, p4 = a_prompts[0], a_prompts[1], a_prompts[2], a_prompts[3]
    p2 = p1[:CHUNK] + other[CHUNK:]  # shares the first chunk only
    p3, p4 = p3[CHUNK:], p4[CHUNK:]  # one full chunk + the tail each
    p5 = tiny_prompts(1, 5 * CHUNK + TAIL, seed=121)[0]

    kv_a, spans_a = tmpfs / "a", tmp_path / "spans-a"
    env_a = {"KVSCOPE_TRACING": "1", "KVSCOPE_SPANS_DIR": str(spans_a)}
    with user_server(tmp_path / "A", env=env_a, profile=_profile("ledger-a", kv_a, 5)) as server:
        _ask(server, "A1-first", p1)
        _wait_files(kv_a, 2)
        _ask(server, "A2-again", p1)
        _ask(server, "A3-diverged", p2)
        _wait_files(kv_a, 3)
        before = set(kv_a.glob(f"*{SUFFIX}"))
        _ask(server, "A4-first", p3)
        _wait_files(kv_a, 4)
        (damaged,) = set(kv_a.glob(f"*{SUFFIX}")) - before
        with open(damaged, "r+b") as f:  # flip one payload byte in place
            f.seek(HEADER_SIZE + 100)
            byte = f.read(1)
            f.seek(HEADER_SIZE + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        _ask(server, "A5-corrupt", p3)
        wait_until(lambda: _chunks(kv_a) == 4, timeout_s=10)  # its recompute may store it again
        time.sleep(0.5)
        log = tmp_path / "A" / "server.log"
        filler = _fill(tmpfs)
        _ask(server, "A6-first", p4)
        assert wait_until(lambda: len(ENOSPC_LINE.findall(log.read_text())) >= 1, 30)
        _ask(server, "A7-enospc", p4)
        assert wait_until(lambda: len(ENOSPC_LINE.findall(log.read_text())) >= 2, 30)
        filler.unlink()
        _ask(server, "A8-big", p5)
        _wait_files(kv_a, 5)
        assert wait_until(lambda: not set(kv_a.glob(f"*{SUFFIX}")) & before, 30)
        _ask(server, "A9-evicted", p1)
        _wait_ledger(spans_a, "A9-evicted")
    _no_kvscope_errors(spans_a, tmp_path / "A" / "server.log")
    table_a = _ledger(spans_a)
    _print_table("server A (kvscope disk tier, capacity 5 chunk files)", table_a)
    _check(table_a, {
        "A1-first": {chunk_outcomes.NEVER_STORED: 2 * CHUNK},
        "A2-again": {"hit:disk": 2 * CHUNK},
        "A3-diverged": {"hit:disk": CHUNK, chunk_outcomes.DIVERGED: CHUNK},
        "A4-first": {chunk_outcomes.NEVER_STORED: CHUNK},
        "A5-corrupt": {chunk_outcomes.REFUSED: CHUNK},
        "A6-first": {chunk_outcomes.NEVER_STORED: CHUNK},
        "A7-enospc": {chunk_outcomes.STORE_ENOSPC: CHUNK},
        "A8-big": {chunk_outcomes.NEVER_STORED: 5 * CHUNK},
        "A9-evicted": {chunk_outcomes.EVICTED_DISK: 2 * CHUNK},
    })
    printed = _analyze(spans_a, tmp_path / "run-a")
    print(printed)
    for line in ("| disk | 3 | 768 |", "| never_stored | 9 | 2304 |", "| diverged | 1 | 256 |",
                 "| refused | 1 | 256 |", "| store_enospc | 1 | 256 |",
                 "| evicted_disk | 2 | 512 |"):
        assert line in printed, line
    rows = table_a.set_index(["request_id", "chunk_index"])
    assert rows.loc[("A3-diverged", 1), "diverged_at"] == CHUNK
    assert rows.loc[("A5-corrupt", 0), "detail"] == "checksum"
    assert rows.loc[("A7-enospc", 0), "detail"].startswith("ENOSPC")
    evicted = rows.loc[("A9-evicted", 0)]
    assert evicted["detail"] == f"capacity {5 * FILE} bytes"
    assert evicted["fact_ns"] > evicted["stored_ns"] > 0


def test_cpu_tier_hits_and_evictions_before_the_disk_tier(tmp_path, tmpfs):
    """Server B, LMCache's CPU tier (8 chunks) then the kvscope disk tier: CPU hits, evicted
    from the CPU tier with no disk copy (its disk writes failed), disk hits."""
    tmpfs = tmpfs("4m")
    q1, q2 = tiny_prompts(2, 2 * CHUNK + TAIL, seed=130)
    q3 = tiny_prompts(1, 7 * CHUNK + TAIL, seed=131)[0]
    kv_b, spans_b = tmpfs / "b", tmp_path / "spans-b"
    env_b = {"KVSCOPE_TRACING": "1", "KVSCOPE_SPANS_DIR": str(spans_b)}
    cpu = {"local_cpu": True, "max_local_cpu_size": 8 * CHUNK_BYTES / 2**30}
    with user_server(tmp_path / "B", env=env_b,
                     profile=_profile("ledger-b", kv_b, 16, **cpu)) as server:
        log = tmp_path / "B" / "server.log"
        filler = _fill(tmpfs)
        _ask(server, "B1-first", q1)  # CPU stores it; the disk writes fail (ENOSPC)
        assert wait_until(lambda: len(ENOSPC_LINE.findall(log.read_text())) >= 2, 30)
        _ask(server, "B2-cpu", q1)
        filler.unlink()
        _ask(server, "B3-first", q2)
        _wait_files(kv_b, 2)
        _ask(server, "B4-big", q3)  # the CPU tier evicts q1 and q2 to make room
        time.sleep(1.0)
        _ask(server, "B5-cpu-evicted", q1)
        _ask(server, "B6-disk", q2)
        _wait_ledger(spans_b, "B6-disk")
    _no_kvscope_errors(spans_b, tmp_path / "B" / "server.log")
    table_b = _ledger(spans_b)
    _print_table("server B (LMCache CPU tier 8 chunks, then the kvscope disk tier)", table_b)
    _check(table_b, {
        "B1-first": {chunk_outcomes.NEVER_STORED: 2 * CHUNK},
        "B2-cpu": {"hit:cpu": 2 * CHUNK},
        "B3-first": {chunk_outcomes.NEVER_STORED: 2 * CHUNK},
        "B4-big": {chunk_outcomes.NEVER_STORED: 7 * CHUNK},
        "B5-cpu-evicted": {chunk_outcomes.EVICTED_CPU: 2 * CHUNK},
        "B6-disk": {"hit:disk": 2 * CHUNK},
    })
    rows = table_b.set_index(["request_id", "chunk_index"])
    assert rows.loc[("B5-cpu-evicted", 0), "detail"] == "no disk copy (store_enospc)"
