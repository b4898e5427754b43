"""LMCache's own disk paths beside kvscope's, each set up the way its code and docs recommend
for a fast local disk, reading the same chunk bytes from the same disk as kvscope.

- **raw-block** (`RustRawBlockBackend`, a storage plugin over the `lmcache_rust_raw_block_io`
  extension): chunks in fixed slots of one device, its index checkpointed into the device, so a
  new server finds what an earlier one stored. Knobs: `use_odirect` on (its default is off,
  which would read through the page cache the study drops; its README's zero-copy path is the
  O_DIRECT one), `io_engine` posix (one `pread` per chunk on the retrieving thread) or io_uring
  (one batch per retrieve, queue depth 256, its default), 4 KiB alignment (the disk's logical
  block), and a 1 s index checkpoint (the default 60 s would leave a server stopped after the
  warm phase without an index on the device). The device is a preallocated-size sparse image
  file on the study's disk, not a loop device: this VM has no spare block device or partition,
  and a loop device on the same disk would add the loop driver's own queue and worker threads
  between the reader and the disk (each read seen twice by the block probes, the one on the
  disk issued by a kernel worker the spans cannot name), while O_DIRECT on the file sends the
  reader's own requests to the disk through ext4's direct I/O path.
- **fs** (`FSConnector`, LMCache's `fs` remote connector, `remote_storage_plugins: [fs]`): one
  file per chunk under a directory, found again by a new server. Knobs:
  `fs_connector_use_odirect` on and `save_chunk_meta` off (the connector turns O_DIRECT off
  while chunk metadata is saved: its 28-byte header would misalign the payload), the naive
  serde (no compression: the bytes on disk are the KV).

The native FS client (`lmcache_fs`, LMCache's multiprocess mode) and the GPU-only paths are in
docs/gpu-host.md, with why each cannot run on vLLM-CPU here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from kvscope.contract import files

RAW_BLOCK_MODULE = "lmcache.v1.storage_backend.plugins.rust_raw_block_backend"
RAW_BLOCK_CLASS = "RustRawBlockBackend"
RAW_BLOCK_PLUGIN = "rust_raw_block"  # the storage_plugins name of the tier
IMAGE = "raw-block.img"  # the raw-block device: a sparse file in the profile's KV directory
IMAGE_BYTES = 64 << 30  # its size; only what is written takes space (stock's 64 GB budget)
IOURING_QUEUE_DEPTH = 256  # the backend's default, kept explicit: the study reports it
FS_PLUGIN = "fs"


def raw_block(engine: str) -> Callable[[Path], dict[str, Any]]:
    def build(kv_dir: Path) -> dict[str, Any]:
        extra = {
            f"storage_plugin.{RAW_BLOCK_PLUGIN}.module_path": RAW_BLOCK_MODULE,
            f"storage_plugin.{RAW_BLOCK_PLUGIN}.class_name": RAW_BLOCK_CLASS,
            "rust_raw_block.device_path": str(Path(kv_dir) / IMAGE),
            "rust_raw_block.io_engine": engine,
            "rust_raw_block.iouring_queue_depth": IOURING_QUEUE_DEPTH,
            "rust_raw_block.use_odirect": True,
            "rust_raw_block.block_align": 4096,
            "rust_raw_block.meta_checkpoint_interval_sec": 1,
        }
        return {"storage_plugins": [RAW_BLOCK_PLUGIN], "extra_config": extra}

    return build


def fs(kv_dir: Path) -> dict[str, Any]:
    return {"remote_storage_plugins": [FS_PLUGIN], "remote_serde": "naive",
            "extra_config": {f"remote_storage_plugin.{FS_PLUGIN}.base_path": str(kv_dir),
                             "fs_connector_use_odirect": True, "save_chunk_meta": False}}


BUILDS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "raw-block-posix": raw_block("posix"), "raw-block-io_uring": raw_block("io_uring"), "fs": fs,
}
# The tier that stores a format in another profile's server (the study's warm phase); the
# engine does not change what is written.
WRITERS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "raw-block": raw_block("posix"), "fs": fs,
}


def prepare_image(kv_dir: Path) -> Path:
    """The raw-block image in `kv_dir`, created sparse (IMAGE_BYTES) when missing; an existing
    one is kept: it holds an earlier server's chunks and index."""
    image = Path(kv_dir) / IMAGE
    if not image.exists():
        with files.atomic_writer(image) as f:
            f.truncate(IMAGE_BYTES)
    return image


def with_copies(config: dict[str, Any], copies: dict[str, Path]) -> dict[str, Any]:
    """`config` plus a writer tier per format in `copies` (chunk format -> its directory),
    listed after the config's own tiers: LMCache asks tiers in order (CPU, local disk, remote,
    plugins) and the config's own tier, holding every chunk, answers every lookup first."""
    out = dict(config)
    for chunk_format, directory in copies.items():
        tier = WRITERS[chunk_format](directory)
        if chunk_format == "raw-block":
            prepare_image(directory)
        for key in ("storage_plugins", "remote_storage_plugins"):
            if key in tier:
                out[key] = [*(out.get(key) or []), *tier[key]]
        out["extra_config"] = {**(out.get("extra_config") or {}), **tier["extra_config"]}
        out.update({k: v for k, v in tier.items()
                    if k not in ("storage_plugins", "remote_storage_plugins", "extra_config")})
    return out


def allocated_bytes(path: Path) -> int:
    """Bytes a (sparse) file holds on disk: what the raw-block tier has written into its image."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0
