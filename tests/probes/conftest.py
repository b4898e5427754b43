# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the probe tests: run directories, a data file on the root disk, a loop device,
and a known O_DIRECT workload (fio) in its own process, so a pid filter can single it out."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from kvscope.contract import rundir
from kvscope.probes.fio import FioReads
from kvscope.probes.nvme_bpf import NVME_DTYPE

DATA = Path(__file__).parent / "data"
SCRATCH = Path("/var/tmp/kvscope-probe-tests")  # on the root disk (/tmp could be tmpfs)


def make_file(path: Path, size_bytes: int) -> None:
    """A file of real (non-sparse) random data, flushed to the device."""
    with open(path, "wb") as f:
        for _ in range(0, size_bytes, 1 << 20):
            f.write(os.urandom(1 << 20))
        os.fsync(f.fileno())


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return rundir.create(tmp_path / "run", {"run_id": "probe-test"})


@pytest.fixture(scope="session")
def scratch() -> Path:
    """A folder on the root disk for backing files (/tmp could be tmpfs)."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    return SCRATCH


@pytest.fixture(scope="session")
def data_file() -> Iterator[Path]:
    SCRATCH.mkdir(parents=True, exist_ok=True)
    path = SCRATCH / f"data-{os.getpid()}.bin"
    make_file(path, 32 << 20)
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def loop_device(data_file: Path) -> Iterator[Path]:
    """A loop device over a copy of the data file, detached afterwards."""
    backing = SCRATCH / f"loop-{os.getpid()}.bin"
    make_file(backing, 32 << 20)
    dev = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(backing)],
                         check=True, capture_output=True, text=True).stdout.strip()
    try:
        yield Path(dev)
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)
        backing.unlink(missing_ok=True)


@pytest.fixture
def workload() -> Callable[..., FioReads]:
    """`workload(path, count=, size=, depth=)`: O_DIRECT reads held until `.go()`."""
    def make(path: Path, *, count: int, size: int, depth: int) -> FioReads:
        return FioReads(path, size=size, depth=depth, count=count, pattern="read")

    return make


@pytest.fixture(scope="session")
def recorded_nvme_data() -> tuple[np.ndarray, Path]:
    """The recorded NVMe events as probe records, and the sysfs slice they go with."""
    return recorded_nvme_records("nvme_events.jsonl"), DATA / "sys"


def recorded_nvme_records(name: str) -> np.ndarray:
    """Recorded nvme tracepoint events (JSON lines) as the NVMe probe's ring-buffer records."""
    lines = [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]
    records = np.zeros(len(lines), dtype=NVME_DTYPE)
    for i, event in enumerate(lines):
        for field in ("ts_ns", "kind", "ctrl_id", "qid", "cid", "opcode", "fctype", "nsid",
                      "status"):
            records[i][field] = event.get(field, 0)
        records[i]["cdw10"] = np.frombuffer(bytes.fromhex(event.get("cdw10", "00" * 24)), "u1")
        records[i]["disk"] = event.get("disk", "").encode()
    return records
