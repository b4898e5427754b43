# SPDX-License-Identifier: Apache-2.0
"""Every OTEL_* / KVSCOPE_* value the tracer uses, parsed once per process, never raising.

A bad value (unparsable, non-finite, or out of its range) falls back to its default (or turns
that exporter off) with one warning line naming the variable, the bad value, what is used
instead and what to set, and is counted as a config error (`failsafe.counts()["config.<VARIABLE>"]`, in the stats and `manifest.tracer`). Parsing
happens at start-up (`tracer.vllm_plugin.register`) and again, from the cache, when the
pipeline is built, so the line and the count appear once per process.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from opentelemetry.sdk.trace import sampling

from kvscope.contract import files
from kvscope.contract.clock import plausible_offset
from kvscope.contract.env import ENV_CLOCK_OFFSET, ENV_SPANS_DIR
from kvscope.tracer import failsafe
from kvscope.tracer.tail_sampling import WARMING_TTFTS, TailRule

FILE_FLUSH_MS = 200  # the files' schedule delay, and OTLP's unless OTEL_BSP_SCHEDULE_DELAY is set
STATS_DIR = "stats"  # RUN/spans/stats/<prefix>-<pid>.json, never *.json in spans/ itself
PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS: dict[str, Callable[[float], sampling.Sampler]] = {
    "always_on": lambda _: sampling.ALWAYS_ON,
    "always_off": lambda _: sampling.ALWAYS_OFF,
    "traceidratio": sampling.TraceIdRatioBased,
    "parentbased_always_on": lambda _: sampling.ParentBased(sampling.ALWAYS_ON),
    "parentbased_always_off": lambda _: sampling.ParentBased(sampling.ALWAYS_OFF),
    "parentbased_traceidratio": lambda r: sampling.ParentBased(sampling.TraceIdRatioBased(r)),
    # every request is recorded whatever its caller's flag; the exporter's TailSampler decides
    "kvscope_tail": lambda _: sampling.ALWAYS_ON,
}
DEFAULT_SAMPLER = "parentbased_always_on"  # the SDK's default
HOUR_MS = 3_600_000
TAIL = "kvscope_tail"
# OTEL_TRACES_SAMPLER_ARG of kvscope_tail, key -> (lowest, highest, whether lowest is allowed):
# past an hour no TTFT is a threshold, and a million TTFTs is past any window's use.
TAIL_RANGES: dict[str, tuple[float, float, bool]] = {
    "ttft_ms": (0, HOUR_MS, False), "percentile": (0, 100, False), "ratio": (0, 1, True),
    "window": (WARMING_TTFTS, 1_000_000, True)}
TAIL_OFF = ("ttft_ms", "percentile")  # the keys that `none` turns off
# variable -> (argument of BatchSpanProcessor, default: the SDK's but the delay, largest value).
# The SDK takes any integer, but a queue of 10^20 spans fails to build (tracing off) and a
# delay of 10^20 ms overflows its worker's wait (that exporter dead, silently); a queue of a
# million spans or an hour's delay is past any use, so larger values fall back.
BSP = {
    "OTEL_BSP_MAX_QUEUE_SIZE": ("max_queue_size", 2048, 1 << 20),
    "OTEL_BSP_SCHEDULE_DELAY": ("schedule_delay_millis", FILE_FLUSH_MS, HOUR_MS),
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": ("max_export_batch_size", 512, 1 << 20),
    "OTEL_BSP_EXPORT_TIMEOUT": ("export_timeout_millis", 30000, HOUR_MS),
}
OTLP_TIMEOUT_S = 10.0  # the SDK's default (it reads OTEL_EXPORTER_OTLP_TIMEOUT as seconds)
MAX_OTLP_TIMEOUT_S = HOUR_MS / 1000
VARIABLES = (ENV_SPANS_DIR, ENV_CLOCK_OFFSET, "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_TIMEOUT",
             "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
             "OTEL_SERVICE_NAME", *BSP)


def identity(env: Mapping[str, str] | None = None) -> str:
    """What decides where a process's spans go and how (the variables above, as set): a
    process hands its rings only to an exporter process of the same identity."""
    env = os.environ if env is None else env
    return json.dumps({name: env.get(name) for name in VARIABLES}, sort_keys=True)


class ConfigError(ValueError):
    """A bad OTEL_*/KVSCOPE_* value (never raised: counted and logged, then a fallback)."""


@dataclass(frozen=True)
class Otlp:
    """Where OTLP export goes. `endpoint` None: the SDK's default (localhost)."""

    endpoint: str | None
    protocol: str
    timeout_s: float
    traces_endpoint: bool  # the endpoint is the full traces URL (no /v1/traces appended)

    def url(self) -> str:
        if self.protocol == "http/protobuf":
            base = self.endpoint or "http://localhost:4318"
            return base if self.traces_endpoint else base.rstrip("/") + "/v1/traces"
        return self.endpoint or "http://localhost:4317"


@dataclass(frozen=True)
class TracerConfig:
    """What the tracer of this process will do."""

    spans_dir: Path | None
    otlp: Otlp | None
    batch: dict[str, int]
    sampler_name: str
    sampler_arg: float
    clock_offset_ns: int | None  # None: measure this process's own
    service_name: str | None
    tail: TailRule | None  # what the exporter keeps under kvscope_tail (None: another sampler)

    def sampler(self) -> sampling.Sampler:
        return SAMPLERS[self.sampler_name](self.sampler_arg)

    def sampler_text(self) -> str:
        if self.tail is not None:
            return f"{self.sampler_name} ({self.tail.describe()})"
        ratio = "traceidratio" in self.sampler_name
        return self.sampler_name + (f" (ratio {self.sampler_arg:g})" if ratio else "")

    def destinations(self) -> list[str]:
        """Where spans go, in words ([] when nowhere)."""
        out = [f"files in {self.spans_dir}"] if self.spans_dir is not None else []
        if self.otlp is not None:
            out.append(f"OTLP {self.otlp.protocol} to {self.otlp.url()}")
        return out


_lock = threading.Lock()
_cache: dict[tuple, TracerConfig] = {}


def load(env: Mapping[str, str] | None = None) -> TracerConfig:
    """The tracer's configuration from `env` (default os.environ); problems are reported on
    the first load of these values in this process only."""
    env = os.environ if env is None else env
    key = (os.getpid(), *((name, env.get(name)) for name in VARIABLES))
    with _lock:
        if key not in _cache:
            _cache[key] = _parse(env)
        return _cache[key]


def reset() -> None:
    """Forget what was parsed (tests)."""
    with _lock:
        _cache.clear()


def _bad(variable: str, value: str, what: str, instead: str, to_set: str) -> None:
    failsafe.count(failsafe.CONFIG + variable,
                   ConfigError(f"{variable}={value!r} is {what}"),
                   fix=f"using {instead}; set {variable} to {to_set} or unset it")


def _parse(env: Mapping[str, str]) -> TracerConfig:
    batch = {arg: _positive_int(env, name, default, maximum)
             for name, (arg, default, maximum) in BSP.items()}
    if batch["max_export_batch_size"] > batch["max_queue_size"]:
        _bad("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", str(batch["max_export_batch_size"]),
             f"larger than the queue (OTEL_BSP_MAX_QUEUE_SIZE={batch['max_queue_size']})",
             f"{batch['max_queue_size']}", "at most OTEL_BSP_MAX_QUEUE_SIZE")
        batch["max_export_batch_size"] = batch["max_queue_size"]
    sampler_name, sampler_arg = _sampler(env)
    return TracerConfig(
        spans_dir=_spans_dir(env), otlp=_otlp(env), batch=batch,
        sampler_name=sampler_name, sampler_arg=sampler_arg, clock_offset_ns=_offset(env),
        service_name=env.get("OTEL_SERVICE_NAME") or None,
        tail=_tail(env) if sampler_name == TAIL else None)


def _positive_int(env: Mapping[str, str], name: str, default: int, maximum: int) -> int:
    value = env.get(name, "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        number = 0
    if 0 < number <= maximum:
        return number
    _bad(name, value, f"not an integer from 1 to {maximum}", f"{default} (the default)",
         f"an integer from 1 to {maximum}")
    return default


def _spans_dir(env: Mapping[str, str]) -> Path | None:
    """The spans directory and its stats/ directory, made 0700 where missing, if both are
    this user's own (contract.files: no other user can plant, swap or read what is written
    there); else None with the one line saying what was found and what to do."""
    value = env.get(ENV_SPANS_DIR, "").strip()
    if not value:
        return None
    path = Path(value)
    try:
        files.private_dir(path)
        files.private_dir(path / STATS_DIR)
        why = "" if os.access(path, os.W_OK | os.X_OK) else "not writable by this process"
    except files.UnsafePath as e:
        why = f"refused: {e}"
    if not why:
        return path
    _bad(ENV_SPANS_DIR, value, why, "no span files (file export off; serving goes on)",
         "a directory of this process's user that no other user can write")
    return None


def _otlp(env: Mapping[str, str]) -> Otlp | None:
    wanted = [w.strip() for w in env.get("OTEL_TRACES_EXPORTER", "").lower().split(",")]
    traces_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    endpoint = traces_endpoint or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if "none" in wanted or not (endpoint or "otlp" in wanted):
        return None
    protocol = _protocol(env)
    if protocol is None:
        return None
    timeout = _timeout(env)
    if timeout is None:
        return None
    return Otlp(endpoint or None, protocol, timeout, bool(traces_endpoint))


def _protocol(env: Mapping[str, str]) -> str | None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = env.get(name, "").strip()
        if not value:
            continue
        if value in PROTOCOLS:
            return value
        if value == "http/json":  # in the spec, not in the Python SDK: same endpoint, protobuf
            _bad(name, value, "not supported by the OpenTelemetry Python exporter",
                 "http/protobuf (same endpoint and port)", "http/protobuf or grpc")
            return "http/protobuf"
        _bad(name, value, "not an OTLP protocol", "no OTLP export", "grpc or http/protobuf")
        return None
    return "grpc"  # vLLM's default too


def _timeout(env: Mapping[str, str]) -> float | None:
    """Seconds, as the Python SDK reads them. The gRPC exporter parses the traces-specific
    variable itself even when given a timeout, so a bad one there leaves no OTLP export."""
    specific = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
    for name in (specific, "OTEL_EXPORTER_OTLP_TIMEOUT"):
        value = env.get(name, "").strip()
        if not value:
            continue
        number = _float(value)
        if number is not None and 0 < number <= MAX_OTLP_TIMEOUT_S:
            return number
        what = f"not a number of seconds above 0 and at most {MAX_OTLP_TIMEOUT_S:g}"
        if name == specific:
            _bad(name, value, what, "no OTLP export (the OTLP exporter reads it itself)",
                 "a number of seconds")
            return None
        _bad(name, value, what, f"{OTLP_TIMEOUT_S:g} s", "a number of seconds")
        return OTLP_TIMEOUT_S
    return OTLP_TIMEOUT_S


def _sampler(env: Mapping[str, str]) -> tuple[str, float]:
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or DEFAULT_SAMPLER
    if name not in SAMPLERS:
        _bad("OTEL_TRACES_SAMPLER", name, "not a sampler the tracer knows",
             DEFAULT_SAMPLER, " or ".join(SAMPLERS))
        name = DEFAULT_SAMPLER
    if name == TAIL:
        return name, 1.0  # its ARG is key=value pairs (_tail)
    value = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    ratio = _float(value) if value else 1.0
    if ratio is None or not 0.0 <= ratio <= 1.0:
        if "traceidratio" in name:
            _bad("OTEL_TRACES_SAMPLER_ARG", value, "not a ratio between 0 and 1",
                 "1.0 (every trace)", "a number between 0 and 1")
        ratio = 1.0
    return name, ratio


def _tail(env: Mapping[str, str]) -> TailRule:
    """kvscope_tail's rule from its ARG's key=value pairs (as the spec's jaeger_remote takes
    its own); each pair it cannot use leaves that key's default, all said in one line."""
    value = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    settings: dict[str, Any] = {}  # TailRule's fields, each checked by _tail_value
    problems = []
    for pair in filter(None, (part.strip() for part in value.split(","))):
        key, equals, text = (part.strip() for part in pair.partition("="))
        try:
            if not equals or key in settings:
                raise ConfigError("not key=value" if not equals else "a key given twice")
            settings[key] = _tail_value(key, text)
        except ConfigError as e:
            problems.append(f"{pair}: {e}")
    rule = TailRule(**settings)
    if problems:
        _bad("OTEL_TRACES_SAMPLER_ARG", value, f"not what {TAIL} takes ({'; '.join(problems)})",
             f"the default for each pair not taken, so {TAIL} {rule.describe()}",
             "comma-separated key=value pairs: " + ", ".join(
                 f"{key} ({_tail_range(key)})" for key in TAIL_RANGES))
    return rule


def _tail_value(key: str, text: str) -> float | int | None:
    """One kvscope_tail setting; ConfigError saying why it is not one."""
    if key not in TAIL_RANGES:
        raise ConfigError(f"{key!r} is not one of {', '.join(TAIL_RANGES)}")
    if key in TAIL_OFF and text.lower() == "none":
        return None
    low, high, low_allowed = TAIL_RANGES[key]
    number = _float(text)
    if (number is None or not (low <= number if low_allowed else low < number) or number > high
            or key == "window" and not number.is_integer()):
        raise ConfigError(f"not {_tail_range(key)}")
    return int(number) if key == "window" else number


def _tail_range(key: str) -> str:
    low, high, low_allowed = TAIL_RANGES[key]
    kind = "an integer" if key == "window" else "a number"
    off = ", or none" if key in TAIL_OFF else ""
    lowest = f"from {low:.15g} to" if low_allowed else f"above {low:.15g} and at most"
    return f"{kind} {lowest} {high:.15g}{off}"


def _offset(env: Mapping[str, str]) -> int | None:
    value = env.get(ENV_CLOCK_OFFSET, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is not None and plausible_offset(number):
        return number
    _bad(ENV_CLOCK_OFFSET, value, "not an integer number of ns within 2^62 of zero",
         "an offset measured in this process (its spans may not line up with the probes' "
         "events to the ns)", "the run's offset (manifest.clock.offset_ns)")
    return None


def _float(value: str) -> float | None:
    """A finite number, else None (NaN and infinities are no setting)."""
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None
