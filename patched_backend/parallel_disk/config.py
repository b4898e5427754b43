# SPDX-License-Identifier: Apache-2.0
"""The backend's knobs, read from LMCache's ``extra_config`` under the ``kvscope.`` prefix.

Kept apart from the backend so a bad value fails with a message naming the key before any
thread or file is created. Every number must be finite and within its range (``RANGES``).
"""

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

PREFIX = "kvscope."
ALIGN = 4096
MODES = ("parallel", "serial")
TUNE = ("off", "auto")
# Test/analysis knob also settable from the server's environment (extra_config wins).
DELAY_ENV = "KVSCOPE_READ_DELAY_MS"

# Defaults chosen from bench/read_path.py on the project's virtio disk (docs/backend.md).
DEFAULT_READ_UNIT = 4 << 20
# Serial mode reads as the seeds' serial path did (LMCache's raw_block at queue depth ~1): one
# 128 KiB read, waited for, then the next. One large read per chunk would not be serial at the
# device: the block layer splits it into max_sectors_kb requests that are all in flight at once.
DEFAULT_SERIAL_READ_UNIT = 128 << 10
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_MAX_INFLIGHT_BYTES = 128 << 20
# Read-ahead at lookup (on in parallel mode): memory budget, capped at half of LMCache's CPU pool.
DEFAULT_PREFETCH_BYTES = 1 << 30
DEFAULT_PREFETCH_TIMEOUT_S = 30.0
# A read not finished by then is a miss (the worker recomputes) rather than a stalled step.
DEFAULT_READ_TIMEOUT_S = 60.0
# Memory held by queued writes, capped at half of LMCache's CPU pool.
DEFAULT_WRITE_QUEUE_BYTES = 1 << 30

# Inclusive range of every numeric knob. The upper bounds are far past any real use; a value
# beyond them is a typo that would overflow a wait (``read_timeout_s: inf`` raised
# OverflowError into LMCache on every get), allocate or spawn without bound, or stall every
# read, so the backend refuses to start instead.
RANGES: dict[str, tuple[float, float]] = {
    "capacity": (1, 1 << 60),
    "read_unit": (1, 1 << 30),  # and a multiple of ALIGN
    "queue_depth": (1, 1024),
    "max_inflight_bytes": (1, 1 << 40),  # and at least read_unit
    "read_delay_ms": (0.0, 60_000.0),
    "write_threads": (1, 256),
    "prefetch_bytes": (1, 1 << 50),
    "prefetch_timeout_s": (0.001, 3600.0),
    "read_timeout_s": (0.001, 3600.0),
    "write_queue_bytes": (1, 1 << 50),
}

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as ``"4MiB"`` / ``"20GB"``; ValueError names the key."""
    if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{key}: {value!r} is not a size; use bytes or e.g. '4MiB', '20GB'")
    if isinstance(value, (int, float)):
        return int(value)
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{key}: {value!r} is not a size; use bytes or a number with a unit "
            f"(KiB, MiB, GiB, KB, MB, GB), e.g. '4MiB' or '20GB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def parse_number(key: str, value: Any, cast: type) -> Any:
    """`value` as an int (`cast` int: no fraction dropped) or a finite float; ValueError names
    the key."""
    kind = "an integer" if cast is int else "a finite number"
    try:
        if isinstance(value, bool) or (cast is int and isinstance(value, float)
                                       and not value.is_integer()):
            raise ValueError
        number = cast(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{key}: {value!r} is not {kind}") from None
    if not math.isfinite(number):
        raise ValueError(f"{key}: {value!r} is not {kind}")
    return number


def check_range(key: str, name: str, value: float) -> None:
    """ValueError naming `key` unless `value` is within RANGES[name]."""
    low, high = RANGES[name]
    if not low <= value <= high:
        raise ValueError(f"{key}: {value!r} is out of range; use a value from {_plain(low)} "
                         f"to {_plain(high)}")


def _plain(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{key}: {value!r} is not a boolean; use true or false")


@dataclass(frozen=True)
class DiskConfig:
    """Validated knobs. In ``serial`` mode (the A/B baseline) one reader takes the chunks in
    turn and reads each as consecutive ``read_unit``-byte reads, one in flight at a time, and
    nothing is read ahead."""

    path: str
    capacity: int
    mode: str = "parallel"
    read_unit: int = DEFAULT_READ_UNIT
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    verify_checksum: bool = True
    odirect: bool = True
    read_delay_ms: float = 0.0
    write_threads: int = 1
    hugepages: bool = True
    prefetch_on_lookup: bool = True
    prefetch_bytes: int = DEFAULT_PREFETCH_BYTES
    prefetch_timeout_s: float = DEFAULT_PREFETCH_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    write_queue_bytes: int = DEFAULT_WRITE_QUEUE_BYTES
    # Stores only, serves no lookup: a second tier writing this format for later servers
    # (the study's shared warm phase) without ever standing in for the tier under study.
    write_only: bool = False
    # A get hands chunks to the KV transfer before their reads end (handoff.py).
    pipeline_transfer: bool = True
    # "auto": read_unit, queue_depth and max_inflight_bytes measured at start (tune.py).
    tune: str = "off"

    def __post_init__(self) -> None:
        for name in RANGES:
            check_range(PREFIX + name, name, getattr(self, name))
        if self.mode not in MODES:
            raise ValueError(f"{PREFIX}mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.tune not in TUNE:
            raise ValueError(f"{PREFIX}tune: {self.tune!r} is not one of {', '.join(TUNE)}")
        if self.tune == "auto" and self.mode == "serial":
            raise ValueError(f"{PREFIX}tune: serial mode is the fixed baseline (one read of "
                             f"{PREFIX}read_unit bytes in flight at a time); set {PREFIX}read_unit "
                             "instead of tuning")
        if self.read_unit <= 0 or self.read_unit % ALIGN:
            raise ValueError(
                f"{PREFIX}read_unit: {self.read_unit} must be a positive multiple of {ALIGN} "
                "bytes (O_DIRECT alignment), e.g. '4MiB'"
            )
        if self.max_inflight_bytes < self.read_unit:
            raise ValueError(
                f"{PREFIX}max_inflight_bytes: {self.max_inflight_bytes} must be >= "
                f"{PREFIX}read_unit ({self.read_unit})"
            )
        if self.prefetch_on_lookup and self.write_only:
            raise ValueError(f"{PREFIX}prefetch_on_lookup: a {PREFIX}write_only tier serves no "
                             "lookups, so it reads nothing ahead")
        if self.prefetch_on_lookup and self.mode == "serial":
            raise ValueError(f"{PREFIX}prefetch_on_lookup: reads ahead need {PREFIX}mode "
                             "'parallel'; serial mode reads only what a get asks for, one read "
                             "at a time")
        if self.pipeline_transfer and self.mode == "serial":
            raise ValueError(f"{PREFIX}pipeline_transfer: copying chunks while later ones are "
                             f"read needs {PREFIX}mode 'parallel'")

    @property
    def effective_queue_depth(self) -> int:
        """Reads in flight: ``queue_depth``, or 1 in serial mode."""
        return 1 if self.mode == "serial" else self.queue_depth


def from_extra_config(extra: Optional[Mapping[str, Any]], fallback_capacity_gb: float = 0.0) -> DiskConfig:
    """Build a DiskConfig from LMCache's ``extra_config``.

    Args:
        extra: LMCache ``extra_config`` (flat dotted keys).
        fallback_capacity_gb: LMCache's ``max_local_disk_size``, used when
            ``kvscope.capacity`` is absent.
    """
    extra = extra or {}
    path = extra.get(PREFIX + "path")
    if not path:
        raise ValueError(
            f"{PREFIX}path is not set: add extra_config['{PREFIX}path'] = <directory for KV chunk files>"
        )
    raw_capacity = extra.get(PREFIX + "capacity")
    if raw_capacity is None and fallback_capacity_gb <= 0:
        raise ValueError(
            f"{PREFIX}capacity is not set: add extra_config['{PREFIX}capacity'], e.g. '20GB' "
            "(or set LMCache's max_local_disk_size in GB)"
        )
    if raw_capacity is None:
        capacity = int(fallback_capacity_gb * 1024**3)
    else:
        capacity = parse_size(PREFIX + "capacity", raw_capacity)

    def size(name: str, default: int) -> int:
        return parse_size(PREFIX + name, extra.get(PREFIX + name, default))

    def number(name: str, default: float, cast: type) -> Any:
        return parse_number(PREFIX + name, extra.get(PREFIX + name, default), cast)

    mode = str(extra.get(PREFIX + "mode", "parallel"))
    read_unit = DEFAULT_SERIAL_READ_UNIT if mode == "serial" else DEFAULT_READ_UNIT
    write_only = _parse_bool(PREFIX + "write_only", extra.get(PREFIX + "write_only", False))
    return DiskConfig(
        path=str(path),
        capacity=capacity,
        mode=mode,
        read_unit=size("read_unit", read_unit),
        queue_depth=number("queue_depth", DEFAULT_QUEUE_DEPTH, int),
        max_inflight_bytes=size("max_inflight_bytes", DEFAULT_MAX_INFLIGHT_BYTES),
        verify_checksum=_parse_bool(PREFIX + "verify_checksum", extra.get(PREFIX + "verify_checksum", True)),
        odirect=_parse_bool(PREFIX + "odirect", extra.get(PREFIX + "odirect", True)),
        read_delay_ms=_read_delay_ms(extra),
        write_threads=number("write_threads", 1, int),
        hugepages=_parse_bool(PREFIX + "hugepages", extra.get(PREFIX + "hugepages", True)),
        prefetch_on_lookup=_parse_bool(PREFIX + "prefetch_on_lookup",
                                       extra.get(PREFIX + "prefetch_on_lookup",
                                                 mode == "parallel" and not write_only)),
        prefetch_bytes=size("prefetch_bytes", DEFAULT_PREFETCH_BYTES),
        prefetch_timeout_s=number("prefetch_timeout_s", DEFAULT_PREFETCH_TIMEOUT_S, float),
        read_timeout_s=number("read_timeout_s", DEFAULT_READ_TIMEOUT_S, float),
        write_queue_bytes=size("write_queue_bytes", DEFAULT_WRITE_QUEUE_BYTES),
        write_only=write_only,
        tune=str(extra.get(PREFIX + "tune", "off")),
        pipeline_transfer=_parse_bool(PREFIX + "pipeline_transfer",
                                      extra.get(PREFIX + "pipeline_transfer",
                                                mode == "parallel")),
    )


def _read_delay_ms(extra: Mapping[str, Any]) -> float:
    """``kvscope.read_delay_ms``, else the server's KVSCOPE_READ_DELAY_MS (read only then, and
    named when it is bad), else 0."""
    if PREFIX + "read_delay_ms" in extra:
        return parse_number(PREFIX + "read_delay_ms", extra[PREFIX + "read_delay_ms"], float)
    delay = parse_number(DELAY_ENV, os.environ.get(DELAY_ENV, "0"), float)
    check_range(DELAY_ENV, "read_delay_ms", delay)
    return delay
