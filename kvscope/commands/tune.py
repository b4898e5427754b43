"""`kvscope tune --kv-dir DIR`: the read knobs for a disk, measured, with the reasoning printed.

The same measurement `kvscope.tune: auto` makes when a server starts (patched_backend/
parallel_disk/tune.py): the device's ceiling, then each read unit through the serving path
itself (reader threads, checksums on, as a server is configured by default): one reader alone,
Little's law for the readers that must be in flight, each candidate checked at its depth, the
finalists read again in turns and ranked by their medians, and of those within 5 % of the best
the one whose readers spent the least CPU per GB chosen.

The directory must pass the checks the backend makes of its own at start-up (dirsafety.py:
the serving user's, private, under trusted parents), so nobody else could have planted the
files it reads; a chunk whose header claims more than a chunk may hold is refused by name.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune", help="measure a KV directory's disk and choose the backend's read knobs",
        epilog="example: kvscope tune --kv-dir /mnt/nvme/kvscope   (prints the extra_config keys)")
    parser.add_argument("--kv-dir", required=True,
                        help="a directory of kvscope chunk files (*.kvc) on the disk to tune for")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvscope.patched_backend.parallel_disk import dirsafety, tune

    try:
        dirsafety.check_private_dir(args.kv_dir, "--kv-dir")
        files, chunk_bytes = tune.chunk_files(Path(args.kv_dir))
    except (dirsafety.UnsafeDirectory, tune.UnfitChunk) as exc:
        print(f"kvscope tune: {exc}", file=sys.stderr)
        return 2
    if not files:
        print(f"kvscope tune: {args.kv_dir} holds under {tune.MIN_BYTES >> 20} MiB of chunk "
              "files (*.kvc); run a warm phase into it first (kvscope run --phases warm "
              "--keep-kv --kv-dir ...)", file=sys.stderr)
        return 2
    print(f"kvscope tune: {len(files)} chunk files of {chunk_bytes / 2**20:g} MiB in "
          f"{args.kv_dir}, read O_DIRECT")
    try:
        choice = tune.choose(files, chunk_bytes, tune.raw_reader, tune.PathReader())
    except OSError as exc:
        print(f"kvscope tune: cannot measure {args.kv_dir}: {exc}; it needs chunk files on a "
              "file system that takes O_DIRECT reads (a disk, not tmpfs), left alone while "
              "it measures", file=sys.stderr)
        return 2
    for line in choice.reasons:
        print(f"  {line}")
    print("extra_config:")
    for name, value in choice.knobs().items():
        print(f"  kvscope.{name}: {value}")
    return 0
