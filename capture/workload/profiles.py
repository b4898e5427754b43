"""Backend profiles: how LMCache stores and reads KV for one run, by name.

Every profile shares the settings that make a cold phase honest: 256-token chunks, a stable
chunk hash (scheduler and worker are separate processes), no CPU tier to serve hits from memory,
and recompute (not failure) when a chunk cannot be loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

COMMON: dict[str, Any] = {
    "chunk_size": 256,
    "save_unfull_chunk": False,
    "pre_caching_hash_algorithm": "sha256_cbor",
    "local_cpu": False,
    "max_local_cpu_size": 2,  # staging allocator only: with local_cpu off it serves no hits
}

KV_TRANSFER_CONFIG: dict[str, Any] = {
    "kv_connector": "LMCacheConnectorV1",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


@dataclass(frozen=True)
class Profile:
    """A named LMCache configuration, built for a KV directory.

    `chunk_format` names what its reads find on disk when the tier persists its index (a new
    server then reads the chunks an earlier one stored: the study's shared warm phase); None
    for a tier whose index lives in memory only. `writer` is a tier storing that format beside
    another profile's own tiers, listed after them (the study's warm server stores every format
    once). `prepare` makes what the tier needs in the directory before the server starts.
    """

    name: str
    summary: str
    build: Callable[[Path], dict[str, Any]] = field(repr=False)
    chunk_format: str | None = None
    writer: Callable[[Path], dict[str, Any]] | None = field(default=None, repr=False)
    prepare: Callable[[Path], None] | None = field(default=None, repr=False)

    def lmcache_config(self, kv_dir: Path) -> dict[str, Any]:
        return {**COMMON, **self.build(Path(kv_dir))}


def _stock(threads: int | None) -> Callable[[Path], dict[str, Any]]:
    def build(kv_dir: Path) -> dict[str, Any]:
        config: dict[str, Any] = {"local_disk": f"file://{kv_dir}", "max_local_disk_size": 64}
        if threads is not None:
            config["extra_config"] = {"disk_io_threads": threads}
        return config

    return build


def _async_loading(build: Callable[[Path], dict[str, Any]]) -> Callable[[Path], dict[str, Any]]:
    """LMCache's async loading: the worker reads a request's chunks when the scheduler looks it
    up, and the request waits in the queue until they are in memory."""
    return lambda kv_dir: {**build(kv_dir), "enable_async_loading": True}


def _kvscope(mode: str, **knobs: Any) -> Callable[[Path], dict[str, Any]]:
    def build(kv_dir: Path) -> dict[str, Any]:
        from kvscope.patched_backend.parallel_disk.lmcache_config import lmcache_settings

        return lmcache_settings(kv_dir, mode=mode, **knobs)

    return build


def _peer(name: str) -> Callable[[Path], dict[str, Any]]:
    def build(kv_dir: Path) -> dict[str, Any]:
        from kvscope.capture.workload import peers

        return peers.BUILDS[name](kv_dir)

    return build


def _peer_prepare(kv_dir: Path) -> None:
    from kvscope.capture.workload import peers

    peers.prepare_image(kv_dir)


def _peer_writer(name: str) -> Callable[[Path], dict[str, Any]]:
    def build(kv_dir: Path) -> dict[str, Any]:
        from kvscope.capture.workload import peers

        return peers.WRITERS[name](kv_dir)

    return build


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("stock-serial", "LMCache's stock disk backend with one read thread", _stock(1)),
        Profile("stock", "LMCache's stock disk backend with its defaults", _stock(None)),
        Profile("kvscope-serial", "kvscope's disk backend as the seeds' serial path: chunks "
                "one at a time, each read as 128 KiB reads, one in flight (depth 1), each "
                "waited for before the next", _kvscope("serial", read_unit="128KiB")),
        Profile("kvscope", "kvscope's parallel-read disk backend, reads started at the "
                "scheduler's lookup, read knobs measured at start (tune auto), each chunk "
                "copied into the KV cache as soon as it is read (docs/backend.md)",
                _kvscope("parallel", tune="auto")),
        Profile("kvscope-classic", "kvscope's parallel reads as before issue 24: 32 readers of "
                "4 MiB, 128 MiB in flight, a request's chunks copied after all are read",
                _kvscope("parallel", read_unit="4MiB", queue_depth=32,
                         max_inflight_bytes="128MiB", pipeline_transfer=False)),
        Profile("kvscope-noprefetch", "kvscope's parallel reads, started only when the worker "
                "loads (kvscope.prefetch_on_lookup off)",
                _kvscope("parallel", prefetch_on_lookup=False)),
        Profile("stock-async", "LMCache's stock disk backend with enable_async_loading",
                _async_loading(_stock(None))),
        Profile("kvscope-async", "kvscope's parallel reads with enable_async_loading",
                _async_loading(_kvscope("parallel"))),
        # LMCache's other disk paths (capture/workload/peers.py says which knobs and why)
        Profile("raw-block-posix", "LMCache's RustRawBlockBackend, posix pread engine, O_DIRECT, "
                "on a preallocated image file on the study's disk", _peer("raw-block-posix"),
                "raw-block", _peer_writer("raw-block"), _peer_prepare),
        Profile("raw-block-io_uring", "LMCache's RustRawBlockBackend, io_uring engine (queue "
                "depth 256), O_DIRECT, on the same kind of image file", _peer("raw-block-io_uring"),
                "raw-block", _peer_writer("raw-block"), _peer_prepare),
        Profile("fs", "LMCache's fs remote connector on a local directory, O_DIRECT reads",
                _peer("fs"), "fs", _peer_writer("fs")),
    )
}
PEERS = ("raw-block-posix", "raw-block-io_uring", "fs")  # LMCache's disk paths beside kvscope


def with_kvscope_copy(config: dict[str, Any], copy_dir: Path) -> dict[str, Any]:
    """`config` plus a write-only kvscope tier on copy_dir, listed after the config's own
    tiers: it stores every chunk in kvscope's format for a later kvscope server and answers no
    lookup, so the config's own tier serves every hit (the study's shared warm phase)."""
    from kvscope.patched_backend.parallel_disk.lmcache_config import lmcache_settings

    if config.get("storage_plugins"):
        raise ValueError("a kvscope copy goes beside LMCache's own disk tier, not a plugin's")
    tier = lmcache_settings(copy_dir, mode="serial", write_only=True, hugepages=False)
    return {**config, **tier,
            "extra_config": {**(config.get("extra_config") or {}), **tier["extra_config"]}}


def register(profile: Profile) -> None:
    """Add a profile (the parallel-read backend registers `kvscope` and `kvscope-serial`)."""
    PROFILES[profile.name] = profile


def get(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown backend profile {name!r}; choose one of: {', '.join(PROFILES)}"
        ) from None
