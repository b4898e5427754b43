# SPDX-License-Identifier: Apache-2.0
"""Read-path benchmark: the disk tier's GB/s next to the device ceiling, measured in one run.

Same chunk set for every path, page cache dropped before each measurement (needs root):

  ceiling         raw O_DIRECT reader, 32 threads x 1 MiB or 4 MiB preadv (the better), no
                  LMCache, no allocation, no checks: the device ceiling, measured on the
                  same files right before or right after each path (alternating)
  stock-serial    LMCache LocalDiskBackend, disk_io_threads=1
  stock           LMCache LocalDiskBackend, defaults (4 threads, buffered)
  kvscope-serial  ParallelDiskBackend, mode=serial (one chunk at a time, 128 KiB reads, depth 1)
  kvscope         ParallelDiskBackend, parallel (knobs below)
  kvscope-noverify  the same, checksums off (what verifying costs)
  kvscope-auto    ParallelDiskBackend, knobs measured at start on its files (tune auto);
                  -noverify: checksums off
  kvscope-auto-twin  auto's knobs set by hand in a store that did not tune: auto against it
                  tells the choice's cost from the store's and the moment's
  kvscope[U,qdD]  hand-set knobs (--sweep): auto is printed against the best of them

Chunk sets: ``large`` = Qwen2.5-32B geometry (64 layers, 8 KV heads, head_dim 128, bf16, 256
tokens = 64 MiB per chunk), ``small`` = Qwen2.5-0.5B geometry (24 layers, 2 KV heads, head_dim
64 = 3 MiB per chunk). Every served chunk's content is checked.

examples:
  sudo .venv/bin/python bench/read_path.py                 # both sets, 4 repetitions
  sudo .venv/bin/python bench/read_path.py --sets large --concurrency 4
  sudo .venv/bin/python bench/read_path.py --sweep         # also kvscope knob variants
"""

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

# read_path_stores sits beside this script, on sys.path as the script's folder
from read_path_stores import ChunkSet, CpuMeter, Store

from kvscope.capture.ceiling import read_files
from kvscope.capture.workload.system import drop_page_cache
from kvscope.patched_backend.parallel_disk.rawread import huge_buffer
from kvscope.patched_backend.parallel_disk.tune import hash_rate

SETS = {
    "large": ChunkSet("large", layers=64, kv_heads=8, head_dim=128, count=16),
    "small": ChunkSet("small", layers=24, kv_heads=2, head_dim=64, count=256),
}
SWEEP = "1MiB:32,4MiB:8,16MiB:2,16MiB:4,64MiB:2,64MiB:4"
TUNED_KNOBS = ("read_unit", "queue_depth", "max_inflight_bytes")
PLUGIN = {
    "storage_plugin.kvscope.module_path": "kvscope.patched_backend.parallel_disk.backend",
    "storage_plugin.kvscope.class_name": "ParallelDiskBackend",
}


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("examples:")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp/kvscope-read-path",
                        help="scratch directory on the disk under test (removed afterwards)")
    parser.add_argument("--sets", default="large,small", help="comma list of: large, small")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="concurrent requests splitting the chunk set (default 1)")
    parser.add_argument("--read-unit", default="4MiB")
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--max-inflight", default="128MiB")
    parser.add_argument("--sweep", nargs="?", const=SWEEP, default="",
                        help="add kvscope knob variants, read_unit:queue_depth pairs "
                        f"(default {SWEEP})")
    parser.add_argument("--paths", default="",
                        help="comma list: measure only these paths (stock-serial is always in)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    return parser.parse_args(argv)


def _kvscope(path: str, **knobs: Any) -> dict[str, Any]:
    extra = {**PLUGIN, "kvscope.path": path, "kvscope.capacity": "64GB",
             **{f"kvscope.{k}": v for k, v in knobs.items()}}
    return {"storage_plugins": ["kvscope"], "extra_config": extra}


def _paths(args: argparse.Namespace, base: str) -> dict[str, tuple[dict[str, Any], str]]:
    stock = os.path.join(base, "stock")
    tuned = {"read_unit": args.read_unit, "queue_depth": args.queue_depth,
             "max_inflight_bytes": args.max_inflight}

    paths = {
        "stock-serial": ({"local_disk": stock + "-1", "max_local_disk_size": 64,
                          "extra_config": {"disk_io_threads": 1}}, "LocalDiskBackend"),
        "stock": ({"local_disk": stock + "-4", "max_local_disk_size": 64}, "LocalDiskBackend"),
        "kvscope-serial": (_kvscope(_own(base, "kvscope-serial"), mode="serial"), "kvscope"),
        "kvscope": (_kvscope(_own(base, "kvscope"), **tuned), "kvscope"),
        "kvscope-noverify": (_kvscope(_own(base, "kvscope-noverify"), verify_checksum=False,
                                      **tuned), "kvscope"),
        # knobs measured at start on its own files (tune.py), beside the hand-set sweep
        "kvscope-auto": (_kvscope(_own(base, "kvscope-auto"), tune="auto"), "kvscope"),
        "kvscope-auto-noverify": (_kvscope(_own(base, "kvscope-auto-noverify"), tune="auto",
                                           verify_checksum=False), "kvscope"),
    }
    for pair in filter(None, args.sweep.split(",")):
        unit, depth = pair.split(":")
        label = f"kvscope[{unit},qd{depth}]"
        paths[label] = (_kvscope(_own(base, label), read_unit=unit, queue_depth=int(depth),
                                 max_inflight_bytes="1GiB"), "kvscope")
    keep = {p.strip() for p in args.paths.split(",") if p.strip()}
    if keep:
        paths = {k: v for k, v in paths.items()
                 if k in keep or k in ("stock-serial", "kvscope-auto") or k.startswith("kvscope[")}
    return paths


def _own(base: str, label: str) -> str:
    """A backend's own directory (each holds its directory's lock)."""
    return os.path.join(base, label.replace("[", "-").replace("]", "").replace(",", "-"))


def _twin(store: Store, base: str) -> tuple[str, dict[str, Any]]:
    """Label and configuration of a store set by hand to the knobs ``store`` tuned to."""
    label = f"{store.label}-twin"
    knobs = store.manager.storage_backends["kvscope"].stats()
    return label, _kvscope(_own(base, label), **{k: knobs[k] for k in TUNED_KNOBS})


def _link_chunks(source: str, target: str) -> None:
    """Hard links of ``source``'s chunk files in ``target``: every kvscope variant reads the
    very same blocks (found through its durable index, as after a restart)."""
    os.makedirs(target, mode=0o700, exist_ok=True)
    for name in os.listdir(source):
        if name.endswith(".kvc"):
            os.link(os.path.join(source, name), os.path.join(target, name))


def _ceiling(files: list[str]) -> tuple[float, float]:
    """GB/s of the better of two raw O_DIRECT QD32 readers (1 MiB, 4 MiB) over ``files``, and
    that reader's CPU-seconds per GB."""
    best, cpu_per_gb = 0.0, 0.0
    for unit in (1 << 20, 4 << 20):
        drop_page_cache()
        with CpuMeter() as meter:
            got = read_files([Path(f) for f in files], unit, 32)
        if got.bytes_per_s / 1e9 > best:
            best, cpu_per_gb = got.bytes_per_s / 1e9, meter.cpu_s / (got.bytes / 1e9)
    return best, cpu_per_gb


def _read_pass(nbytes: int) -> float:
    """CPU-seconds per GB of numpy's SIMD max over ``nbytes`` of memory not in cache, 1 MiB at
    a time: what any verification that reads every byte costs at least (the memory bandwidth of
    one core), to hold the checksum's cost against."""
    data = np.frombuffer(huge_buffer(nbytes), dtype=np.uint8)
    block = 1 << 20
    started = time.thread_time()
    for offset in range(0, nbytes, block):
        data[offset:offset + block].max()
    return (time.thread_time() - started) / (nbytes / 1e9)


def _measure_set(chunk_set: ChunkSet, args: argparse.Namespace) -> dict[str, dict]:
    base = os.path.join(args.dir, chunk_set.name)
    shutil.rmtree(base, ignore_errors=True)
    stores: dict[str, Store] = {}
    try:
        # the stock stores and the first kvscope store write the chunks; later kvscope
        # variants get hard links to the first one's files
        written = None
        for label, (keys, loc) in _paths(args, base).items():
            if loc == "kvscope" and written is not None:
                _link_chunks(written, keys["extra_config"]["kvscope.path"])
            stores[label] = Store(label, chunk_set, keys, loc)
            if len(stores[label].files()) == 0:
                stores[label].fill()
            if loc == "kvscope" and written is None:
                written = keys["extra_config"]["kvscope.path"]
            if label == "kvscope-auto" and written is not None:
                twin, twin_keys = _twin(stores[label], base)
                _link_chunks(written, twin_keys["extra_config"]["kvscope.path"])
                stores[twin] = Store(twin, chunk_set, twin_keys, loc)
        # As vLLM's engine core does after start-up (freeze_gc_heap): the start-up heap is left
        # out of the collector's full passes; without it the first one (~0.3 s of CPU here)
        # lands in whichever measurement it falls in.
        gc.collect()
        gc.freeze()
        nbytes = chunk_set.chunk_bytes * chunk_set.count
        gbps: dict[str, list[float]] = {label: [] for label in stores}
        ceiling: dict[str, list[float]] = {label: [] for label in stores}
        cpu: dict[str, list[float]] = {label: [] for label in stores}  # CPU-s per GB read
        wait: dict[str, list[float]] = {label: [] for label in stores}  # waiting for a core
        raw_cpu: list[float] = []  # the ceiling reader's CPU-s per GB
        labels = list(stores)
        for rep in range(args.reps):
            # each repetition starts one store later: none is always read right after the same
            # neighbour, nor always in the same moment of the repetition
            for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
                store = stores[label]
                # pair each measurement with a ceiling on the same files, alternating which
                # goes first: the virtio host's cache then favours neither side
                first_ceiling = rep % 2 == 0
                if first_ceiling:
                    ceiling[label].append(_ceiling(store.files())[0])
                drop_page_cache()
                with CpuMeter() as meter:
                    seconds, served = store.read_all(args.concurrency)
                store.check_and_release(served)
                gbps[label].append(nbytes / seconds / 1e9)
                cpu[label].append(meter.cpu_s / (nbytes / 1e9))
                wait[label].append((meter.wait_s or 0.0) / (nbytes / 1e9))
                if not first_ceiling:
                    rate, raw = _ceiling(store.files())
                    ceiling[label].append(rate)
                    raw_cpu.append(raw)
            print(f"  rep {rep + 1} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
                f"{k} {v[-1]:.2f}/{ceiling[k][-1]:.2f} ({cpu[k][-1]:.3f} CPU-s/GB)"
                for k, v in gbps.items()), flush=True)
        knobs = {label: store.manager.storage_backends["kvscope"].stats()
                 for label, store in stores.items() if store.location == "kvscope"}
        return {"gbps": gbps, "ceiling": ceiling, "cpu": cpu, "wait": wait, "raw_cpu": raw_cpu,
                "knobs": knobs}
    finally:
        for store in stores.values():
            store.close()
        shutil.rmtree(base, ignore_errors=True)


def _table(chunk_set: ChunkSet, measured: dict[str, dict], concurrency: int) -> list[dict]:
    gbps, ceiling = measured["gbps"], measured["ceiling"]
    cpu, wait = measured["cpu"], measured["wait"]
    serial = gbps["stock-serial"]
    rows = []
    for label, values in gbps.items():
        rows.append({
            "set": chunk_set.name, "path": label, "concurrency": concurrency,
            "gbps_median": statistics.median(values), "gbps": values,
            "ceiling_gbps_median": statistics.median(ceiling[label]),
            "ceiling_gbps": ceiling[label],
            "x_ceiling": statistics.median(
                v / c for v, c in zip(values, ceiling[label], strict=True)),
            "x_stock_serial": statistics.median(v / s for v, s in zip(values, serial, strict=True)),
            "cpu_s_per_gb": statistics.median(cpu[label]),
            "core_wait_s_per_gb": statistics.median(wait[label]),
        })
    size = chunk_set.chunk_bytes / 2**20
    print(f"\n{chunk_set.name}: {chunk_set.count} chunks x {size:g} MiB, concurrency {concurrency}"
          f" (medians; x ceiling = median of paired ratios)")
    print(f"{'path':<26}{'GB/s':>7}{'ceiling GB/s':>14}{'x ceiling':>11}{'x stock-serial':>16}"
          f"{'CPU-s/GB':>10}{'core-wait s/GB':>16}")
    for r in rows:
        print(f"{r['path']:<26}{r['gbps_median']:>7.2f}{r['ceiling_gbps_median']:>14.2f}"
              f"{r['x_ceiling']:>11.2f}{r['x_stock_serial']:>16.2f}{r['cpu_s_per_gb']:>10.3f}"
              f"{r['core_wait_s_per_gb']:>16.3f}")
    if measured["raw_cpu"]:
        print(f"{'(ceiling reader)':<26}{'':>48}{statistics.median(measured['raw_cpu']):>10.3f}"
              f"{'-':>16}")
    knobs = measured["knobs"]
    for label, k in knobs.items():
        print(f"{label} knobs: read_unit {k['read_unit'] >> 20} MiB, queue_depth "
              f"{k['queue_depth']}, max_inflight_bytes {k['max_inflight_bytes'] >> 20} MiB")
    hand = [r for r in rows if r["path"].startswith("kvscope[") or r["path"] == "kvscope"]
    auto = next((r for r in rows if r["path"] == "kvscope-auto"), None)
    if auto and hand:
        best = max(hand, key=lambda r: r["x_ceiling"])
        print(f"kvscope-auto / best hand-set ({best['path']}): "
              f"{auto['x_ceiling'] / best['x_ceiling']:.3f} (x ceiling, paired medians)")
        # the same files read seconds apart: no ceiling's own noise in the ratio
        by_rate = {r["path"]: _same_rep(auto, r) for r in hand}
        strongest = min(by_rate, key=by_rate.__getitem__)
        print(f"kvscope-auto / best hand-set ({strongest}): {by_rate[strongest]:.3f} (median "
              "of the GB/s ratios of each repetition)")
    twin = next((r for r in rows if r["path"] == "kvscope-auto-twin"), None)
    if auto and twin:
        print(f"kvscope-auto / kvscope-auto-twin (the same knobs, not tuned): "
              f"{auto['x_ceiling'] / twin['x_ceiling']:.3f} (x ceiling), "
              f"{_same_rep(auto, twin):.3f} (GB/s of each repetition)")
    return rows


def _same_rep(row: dict, other: dict) -> float:
    """Median over the repetitions of ``row``'s GB/s over ``other``'s in the same one."""
    return statistics.median(a / b for a, b in zip(row["gbps"], other["gbps"], strict=True))


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark; exit code 0, or 2 when the page cache cannot be dropped."""
    args = _parse(argv)
    logging.getLogger("lmcache").setLevel(logging.ERROR)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    if os.geteuid() != 0:
        print("ERROR: cannot drop the page cache (needs root): cold reads would be cached reads",
              file=sys.stderr)
        return 2
    names = [n.strip() for n in args.sets.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETS]
    if unknown:
        print(f"ERROR: unknown --sets {unknown}; choose from {', '.join(SETS)}", file=sys.stderr)
        return 2
    cold, hot = (1e9 / hash_rate(512 << 20, in_cache) for in_cache in (False, True))
    print(f"verification floor: one XXH3-64 pass over data not in cache {cold:.3f} CPU-s/GB "
          f"(in cache {hot:.3f}); O_DIRECT data arrives in memory, not in cache; the cheapest "
          f"pass that reads every byte (SIMD max) {_read_pass(512 << 20):.3f}", flush=True)
    rows = []
    for name in names:
        print(f"{name}: writing and reading ({args.reps} repetitions)", flush=True)
        rows += _table(SETS[name], _measure_set(SETS[name], args), args.concurrency)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
