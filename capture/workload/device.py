"""The device a run or study reads its KV chunks from: the real disk under its KV directory, or
a device twin (capture/device_twin.py) that kvscope builds for it and holds while it runs.

Why one place: `kvscope run` and `kvscope demo` take the same `--device`, and a study keeps one
twin up across all its runs (each run's server then reads chunk files another run stored), so
the twin is made where the command starts and handed down, not made per run.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

from kvscope.capture import device_twin
from kvscope.capture.device_twin import PROFILES, Profile, Twin

DISK = "disk"
TWIN = "twin:"


def help_text() -> str:
    """The `--device` help: the real disk, then each twin profile with its one-line about."""
    twins = "; ".join(f"{TWIN}{p.name} ({p.about})" for p in PROFILES.values())
    return (f"what the KV chunks are read from: {DISK} (default: the real disk under the KV "
            f"directory) or a device twin kvscope builds and tears down (root needed): {twins}")


def twin_profile(device: str) -> Profile | None:
    """The twin profile `device` names, None for the real disk; ValueError naming the choices."""
    if device == DISK:
        return None
    if device.startswith(TWIN) and device[len(TWIN):] in PROFILES:
        return PROFILES[device[len(TWIN):]]
    choices = ", ".join([DISK, *(TWIN + name for name in PROFILES)])
    raise ValueError(f"--device {device!r}: expected one of {choices}")


def check(device: str) -> Profile | None:
    """`twin_profile`, and for a twin the root check, before anything is made.

    Raises:
        ValueError: an unknown device. DeviceTwinError: a twin without root.
    """
    profile = twin_profile(device)
    if profile is not None:
        device_twin.require_root()
    return profile


def refuse_place(device: str, place: Path | None, flag: str) -> None:
    """ValueError when a twin is asked for and `flag` also places the chunks (a twin's chunks
    go on its own file system, or it would measure the wrong disk)."""
    if place is not None and twin_profile(device) is not None:
        raise ValueError(f"{flag} and --device {device} both say where the chunks go: give one")


@contextmanager
def held(device: str, parent: Path) -> Iterator[Twin | None]:
    """The twin `device` names, up for the body and torn down however the body ends (its
    backing file in a private folder under `parent`, on the real disk); None for the disk."""
    profile = check(device)
    if profile is None:
        yield None
        return
    from kvscope.patched_backend.parallel_disk.dirsafety import prepare_private_dir

    with device_twin.device_twin(profile, prepare_private_dir(parent, "device twin folder")
                                 ) as twin:
        yield twin


def manifest_section(twin: Twin | None, disk: str) -> dict[str, Any]:
    """manifest.device: the block device the chunks were read from and, for a twin, what it
    imitates and the stack's own latency per read."""
    if twin is None:
        return {"kind": "disk", "name": disk}
    return {"kind": "twin", "name": twin.disk, "profile": asdict(twin.profile),
            "stack_latency_us": round(twin.stack_latency_us, 1)}


def section_for(twin: Twin | None, where: Path) -> dict[str, Any]:
    """`manifest_section` before the KV directory exists: the disk under `where`'s nearest
    existing folder."""
    from kvscope.contract.host import whole_disk

    existing = next(p for p in (where, *where.parents) if p.exists())
    return manifest_section(twin, whole_disk(existing))


def describe(section: dict[str, Any], where: Path) -> str:
    """One line for the demo: which device it reads (`loop3, twin nvmeof-tcp-x4 (...)`)."""
    if section["kind"] == "twin":
        profile = section["profile"]
        return f"{section['name']}, twin {profile['name']} ({profile['about']})"
    return f"{section['name'] or '?'} (the real disk under {where})"
