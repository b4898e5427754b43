"""`kvscope record --url URL --out RUN`: a run directory from a vLLM server kvscope did not start."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

EXAMPLES = """examples:
  kvscope record --url http://127.0.0.1:8000 --out runs/prod --duration 60
  kvscope record --pid 4242 --out runs/prod                 # until Ctrl-C
  kvscope record --url http://127.0.0.1:8000 --out runs/r --otlp-listen 127.0.0.1:4317
then: kvscope analyze runs/prod

The server traces itself (KVSCOPE_TRACING=1 in its environment) into KVSCOPE_SPANS_DIR, whose
files written during the recording are copied into RUN/spans, or to an OTLP endpoint, which
--otlp-listen provides. Probes (root only) run on the server's whole process tree and on the
disks of its LMCache paths. RUN must not exist (or be an empty directory of yours); it is made
0700, and under sudo it is handed to the user who ran sudo when the recording ends.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "record", help="record a running vLLM server (spans, probes, metrics) into a run",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000 (finds "
                        "the API server by its port unless --pid is given)")
    parser.add_argument("--pid", type=int, help="the vLLM API server's pid (the URL then comes "
                        "from its --host/--port unless --url is given)")
    parser.add_argument("--out", required=True, type=Path, help="new run directory")
    parser.add_argument("--duration", type=float, help="seconds to record (default: until "
                        "Ctrl-C / SIGTERM)")
    parser.add_argument("--otlp-listen", metavar="HOST:PORT",
                        help="run an OTLP/gRPC receiver here for the server's spans")
    parser.add_argument("--kv-dir", type=Path, action="append", default=[],
                        help="LMCache disk directory to probe (default: from the server's "
                        "LMCACHE_CONFIG_FILE); repeatable")
    parser.add_argument("--no-probes", action="store_true", help="do not attach eBPF probes")
    parser.add_argument("--probe-mode", choices=("per-io", "aggregate"), default="per-io",
                        help="per-io: a row per I/O; aggregate: in-kernel histograms for every "
                        "disk, rows only for the server's processes (for long recordings on "
                        "busy hosts; docs/probes.md)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvscope.contract import files, rundir
    from kvscope.capture.record import recording, server_processes

    made = files.missing_parts(args.out)
    fresh = not (args.out / rundir.MANIFEST).exists()  # a run found there is never handed over
    try:
        server = server_processes.find(args.pid, args.url)
        url = args.url or _url_from_cmdline(server.cmdline)
        opts = recording.RecordOptions(out=args.out, url=url.rstrip("/"),
                                       duration_s=args.duration, otlp_listen=args.otlp_listen,
                                       probes=not args.no_probes, kv_dirs=args.kv_dir,
                                       probe_mode=args.probe_mode)
        stop = threading.Event()
        previous = {s: signal.signal(s, lambda *_: stop.set())
                    for s in (signal.SIGINT, signal.SIGTERM)}
        print(f"kvscope record: server pid {server.api_pid} ({len(server.pids)} processes) at "
              f"{url}, into {args.out}", file=sys.stderr)
        try:
            done = recording.record(server, opts, stop,
                                    progress=lambda line: print(line, file=sys.stderr))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if fresh:
                _hand_to_sudo_user(args.out, made)
    except (server_processes.ServerNotFound, rundir.RunDirError, ValueError) as e:
        print(f"kvscope record: {e}", file=sys.stderr)
        return 2
    for line in done.missing:
        print(f"kvscope record: missing: {line}", file=sys.stderr)
    print(f"kvscope record: {done.span_files} span files in {done.run}; next: "
          f"kvscope analyze {done.run}")
    return 0


def _hand_to_sudo_user(out: Path, made: list[Path]) -> None:
    """Under sudo, the run (and the directories made for it) to the user who ran sudo, so that
    their `kvscope analyze RUN` can read and write it."""
    from kvscope.contract import files, rundir

    invoker = files.sudo_invoker()
    if invoker is None or not (out / rundir.MANIFEST).exists():
        return
    for directory in made[:-1]:  # the parents made for the run: themselves only
        os.chown(directory, *invoker, follow_symlinks=False)
    files.hand_over(out, *invoker)
    print(f"kvscope record: {out} handed to uid {invoker[0]} (who ran sudo)", file=sys.stderr)


def _url_from_cmdline(cmdline: tuple[str, ...]) -> str:
    """The API server's URL from its own --host/--port (vLLM's defaults otherwise)."""
    def value(flag: str, default: str) -> str:
        for i, arg in enumerate(cmdline):
            if arg == flag and i + 1 < len(cmdline):
                return cmdline[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
        return default

    host = value("--host", "127.0.0.1")
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:" \
           f"{value('--port', '8000')}"
