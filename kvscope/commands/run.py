"""`kvscope run`: drive a live vLLM + LMCache server through warm and cold phases."""

from __future__ import annotations

import argparse
import datetime as dt
import signal
import sys
from pathlib import Path

EXAMPLES = """examples:
  kvscope run                                   # qwen2.5-32b twin, stock backend, warm + cold
  kvscope run --profile stock-serial --concurrency 1,8,16 --requests 16
  kvscope run --model tiny --requests 4 --prompt-tokens 512 --out runs/smoke
"""


def _levels(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected e.g. 1,8,16, got {text!r}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvscope.capture.workload import device
    from kvscope.capture.workload.profiles import PROFILES
    from kvscope.capture.workload.options import RunOptions

    defaults = RunOptions(out=Path("."))
    p = subparsers.add_parser(
        "run", help="run a warm/cold workload against a live vLLM + LMCache server",
        description="Start vLLM with LMCache on a backend profile, send streaming requests in a "
        "warm phase (compute and store) and cold phases (page cache dropped, KV read from disk), "
        "and write a run directory (docs/run-directory.md).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, help="run directory to create (default runs/<time>-<profile>)")
    p.add_argument("--model", default=defaults.model, help="twin name (kvscope model list)")
    p.add_argument("--models-dir", type=Path, default=defaults.models_dir)
    p.add_argument("--profile", default=defaults.profile,
                   help=f"backend profile: {', '.join(PROFILES)}")
    p.add_argument("--requests", type=int, default=defaults.requests, help="prompts per phase")
    p.add_argument("--concurrency", type=_levels, default=defaults.concurrency,
                   help="requests in flight; a list runs one cold phase per level (1,8,16)")
    p.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    p.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="tokens every prompt shares at its start (default: unique prompts)")
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    p.add_argument("--phases", default="warm,cold", help="warm and/or cold, in order")
    p.add_argument("--warm-concurrency", type=int, default=defaults.warm_concurrency,
                   help="requests in flight while warming (1: every prompt stored whole)")
    p.add_argument("--kv-dir", type=Path, help="where LMCache keeps chunks (default /var/tmp/kvscope)")
    p.add_argument("--device", default=defaults.device, help=device.help_text())
    p.add_argument("--keep-kv", action="store_true", help="keep the chunk files after the run")
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--no-probes", dest="probes", action="store_false",
                   help="do not run the block/NVMe probes around each phase")
    p.add_argument("--tracing", action=argparse.BooleanOptionalAction, default=True,
                   help="OpenTelemetry spans into RUN/spans/ and to OTEL_EXPORTER_OTLP_* if set "
                   "(default on; docs/tracing.md)")
    p.add_argument("--kv-cache-gib", type=int, help="vLLM CPU KV cache size (default: sized to fit)")
    p.set_defaults(func=run)


def options_from_args(args: argparse.Namespace):
    from kvscope.capture.workload.options import RunOptions

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return RunOptions(
        out=args.out or Path("runs") / f"{stamp}-{args.profile}",
        model=args.model, models_dir=args.models_dir, profile=args.profile,
        requests=args.requests, concurrency=args.concurrency, prompt_tokens=args.prompt_tokens,
        shared_prefix_tokens=args.shared_prefix_tokens, max_tokens=args.max_tokens,
        phases=[p for p in args.phases.split(",") if p], warm_concurrency=args.warm_concurrency,
        kv_dir=args.kv_dir, device=args.device,
        keep_kv=args.keep_kv, host=args.host, port=args.port, seed=args.seed,
        kv_cache_gib=args.kv_cache_gib, probes=args.probes, tracing=args.tracing,
        command=sys.argv,
    )


class Terminated(BaseException):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so the server is stopped on the way out."""


def _terminate(signum: int, _frame: object) -> None:
    raise Terminated(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    from kvscope.patched_backend.parallel_disk.dirlock import DirectoryInUse

    from kvscope.capture.device_twin import DeviceTwinError
    from kvscope.capture.workload import report
    from kvscope.capture.workload.runner import execute
    from kvscope.capture.workload.server import ServerError
    from kvscope.capture.workload.system import HostError

    opts = options_from_args(args)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    try:
        path = execute(opts)
    except (ValueError, HostError, ServerError, FileExistsError, DirectoryInUse,
            DeviceTwinError) as e:
        print(f"kvscope run: error: {e}", file=sys.stderr)
        return 2
    except Terminated as e:
        print(f"kvscope run: stopped by {e}; the server (and any device twin) was stopped",
              file=sys.stderr)
        return 128 + getattr(signal, str(e)).value
    print(report.phase_table(path))
    print(f"\nrun directory: {path}")
    failure = report.first_failure(path)
    if failure:
        print(f"kvscope run: requests failed, e.g. {failure}", file=sys.stderr)
        return 1
    return 0
