"""One clock for every producer: CLOCK_MONOTONIC ns, mapped to epoch ns by one measured offset.

bpf_ktime_get_ns() and time.monotonic_ns() read the same clock, so probes, spans and the client
all stamp monotonic time; the offset (recorded in the manifest, and handed to the server as
env.ENV_CLOCK_OFFSET) turns it into wall time once: epoch_ns = monotonic_ns + offset_ns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# The largest offset taken as a clock offset (about 146 years of ns): monotonic + offset must
# fit the int64 columns and OTLP's fixed64 times, so a larger one is a typo or tampering.
MAX_OFFSET_NS = 1 << 62


def plausible_offset(value: object) -> bool:
    """Whether `value` can be an offset: an integer (not a bool or float) within MAX_OFFSET_NS."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_OFFSET_NS


@dataclass(frozen=True)
class ClockOffset:
    """epoch_ns = monotonic_ns + offset_ns, known to within uncertainty_ns."""

    offset_ns: int
    uncertainty_ns: int


def measure_offset(samples: int = 16) -> ClockOffset:
    """Keep the tightest (monotonic, wall, monotonic) bracket of several samples."""
    best: tuple[int, int] | None = None
    for _ in range(samples):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        width = after - before
        offset = wall - (before + width // 2)
        if best is None or width < best[1]:
            best = (offset, width)
    assert best is not None
    return ClockOffset(offset_ns=best[0], uncertainty_ns=max(best[1] // 2, 1))
