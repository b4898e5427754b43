# SPDX-License-Identifier: Apache-2.0
"""Live fault matrix (issue 14): what a real server does with each fault, logprobs compared.

Tiny twin, the vLLM OpenAI server started as a user would (kvscope.testkit.live_backend.tiny_server). A warm
server computes one prompt per fault (its first-token logprob is the recomputed reference)
and stores their chunks. Both chunks of each faulted prompt are then damaged: a flipped
payload byte, truncated, deleted, replaced by junk, planted by another user (another
prompt's KV under this prompt's names, owned by uid 12345). A restarted server must serve
every prompt with the reference logprob: intact chunks loaded, damaged ones refused and
counted, never served. Then a second server on the same directory runs without the disk
tier (a clear error in its log) and gives the reference too. Last, a server on a 3 MiB tmpfs: ENOSPC skips stores, never damages
what is served. The rows printed at the end are the table in docs/backend.md.
"""

import os
import re
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvscope.patched_backend.parallel_disk.chunkfile import HEADER_SIZE, encode_header, read_header
from kvscope.testkit.live_backend import chunk_files, first_token, server_log, temp_files, tiny_server

pytestmark = [pytest.mark.live, pytest.mark.root]

FAULTS = ["intact", "corrupt", "truncated", "missing", "foreign", "planted"]
PROMPTS = {name: [(31 * i + 17 * n + 5) % 1000 + 1 for i in range(600)]
           for n, name in enumerate(FAULTS + ["donor"])}
ROWS: list[str] = []


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stored(kv: Path, before: set[Path], count: int = 2) -> list[Path]:
    """The ``count`` chunk files that appear after ``before`` (the writes are asynchronous)."""
    deadline = time.monotonic() + 120
    while True:
        new = sorted(set(chunk_files(kv)) - before)
        if len(new) >= count and not temp_files(kv):
            return new
        assert time.monotonic() < deadline, f"chunks not stored in {kv}"
        time.sleep(0.2)


def _plant(target: Path, donor: Path) -> None:
    """``donor``'s payload under ``target``'s key (a valid header), owned by another user."""
    header, _ = read_header(str(target))
    donor_header, _ = read_header(str(donor))
    data = donor.read_bytes()[HEADER_SIZE:]
    planted = replace(donor_header, key=header.key, cached_positions=header.cached_positions)
    target.write_bytes(encode_header(planted) + data)
    os.chown(target, 12345, 12345)


def _damage(kind: str, files: list[Path], donor: list[Path]) -> None:
    for path, other in zip(files, donor, strict=True):
        if kind == "corrupt":
            data = bytearray(path.read_bytes())
            data[HEADER_SIZE + 999] ^= 0x40
            path.write_bytes(bytes(data))
        elif kind == "truncated":
            os.truncate(path, path.stat().st_size - 4096)
        elif kind == "missing":
            path.unlink()
        elif kind == "foreign":
            path.write_bytes(b"not a kvscope chunk".ljust(path.stat().st_size, b"\0"))
        elif kind == "planted":
            _plant(path, other)


def _counted(log: str) -> dict[str, int]:
    """Refusals the server logged: start-up summary lines and read-time refusals."""
    counts: dict[str, int] = {}
    for n, reason in re.findall(r"(\d+) chunk file\(s\) refused at start-up \((\w+)\)", log):
        counts[reason] = counts.get(reason, 0) + int(n)
    for reason in re.findall(r"chunk \S+ refused \((\w+)\)", log):
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def _row(fault: str, did: str, counted: str, ref: float, got: float, cached: int) -> None:
    ROWS.append(f"| {fault} | {did} | {counted} | {ref:.4f} | {got:.4f} | {cached} |")
    assert got == pytest.approx(ref, abs=1e-4), (fault, ref, got)


@pytest.mark.timeout(2400)  # four tiny-twin servers, two at once
def test_fault_matrix_serves_only_verified_kv(tmp_path):
    kv = tmp_path / "kv"
    reference, files = {}, {}
    with tiny_server(tmp_path / "warm", kv, _port()) as warm:
        for name, prompt in PROMPTS.items():
            before = set(chunk_files(kv))
            reference[name], cached = first_token(warm, prompt)
            assert cached == 0
            files[name] = _stored(kv, before)
    for name in FAULTS[1:]:
        _damage(name, files[name], files["donor"])
    with tiny_server(tmp_path / "restart", kv, _port()) as restart:
        results = {name: first_token(restart, PROMPTS[name]) for name in FAULTS}
        log = server_log(tmp_path / "restart")
        with tiny_server(tmp_path / "second", kv, _port()) as second:
            got, cached = first_token(second, PROMPTS["intact"])
        assert f"KV directory {kv} is in use by another kvscope server" in server_log(
            tmp_path / "second")
    _row("second server, same directory", "its disk tier refuses to start (`KV directory ... "
         "is in use by another kvscope server (pid N on HOST)` in its log); serves without it",
         "-", reference["intact"], got, cached)
    assert cached == 0
    counted = _counted(log)
    checksum = counted.pop("checksum", 0)
    assert counted == {"truncated": 2, "foreign": 2, "untrusted": 2} and checksum >= 1, counted
    did = {
        "intact": ("both chunks loaded", "-"),
        "corrupt": ("refused at read (XXH3), vLLM recomputes", f"checksum: {checksum}, *.corrupt"),
        "truncated": ("refused at start-up", "truncated: 2, *.corrupt"),
        "missing": ("not indexed (miss)", "-"),
        "foreign": ("refused at start-up", "foreign: 2, *.corrupt"),
        "planted": ("refused at start-up, file left alone", "untrusted: 2"),
    }
    for name in FAULTS:
        got, cached = results[name]
        _row(name, *did[name], reference[name], got, cached)
    assert results["intact"][1] == 512
    print("\n" + "\n".join(ROWS))


@pytest.fixture
def tiny_fs(tmpfs):
    return tmpfs("3m")


def test_enospc_skips_stores_and_serves_the_rest(tmp_path, tiny_fs):
    kv = tiny_fs / "kv"
    names = list(PROMPTS)
    with tiny_server(tmp_path / "enospc", kv, _port()) as server:
        reference = {name: first_token(server, PROMPTS[name])[0] for name in names}
        time.sleep(3.0)  # let the asynchronous stores finish or fail
        again = {name: first_token(server, PROMPTS[name]) for name in names}
        log = server_log(tmp_path / "enospc")
    failures = len(re.findall(r"store of \S+ skipped: ENOSPC", log))
    assert failures > 0
    hits = [name for name in names if again[name][1] > 0]
    assert hits  # what fitted is served
    for n, name in enumerate(names):
        _row(f"ENOSPC (prompt {n})", "store skipped when full; served what fitted",
             f"store_failures: {failures} in all", reference[name], *again[name])
    print("\n" + "\n".join(ROWS[-len(names):]))
