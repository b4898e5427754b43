# SPDX-License-Identifier: Apache-2.0
"""Read path end to end: cold TTFT of the live stack per backend profile, side by side.

For each profile, two ``kvscope run`` (vLLM-CPU + LMCache, real servers). The first stores
every prompt's chunks: warm at concurrency 1 (at higher concurrency vLLM splits prefills and
LMCache then stores only part of some prompts), then one cold pass, only because the driver
waits for the asynchronous chunk writes before a cold phase and not before stopping the
server. The second is a true cold start (a new server, chunks only on disk, page cache
dropped, no CPU tier): one cold phase per concurrency level. The stock disk tier keeps no
index across restarts, so its first cold level recomputes (cached tokens 0) and later levels
read the chunks that level stored: the table shows the cached tokens next to the TTFT. Prints cold TTFT median and p99 per profile and
concurrency, and the ratios of each profile to the last one (``kvscope``), measured in the
same invocation, with the load average (other users of the machine) before and after.

examples:
  sudo .venv/bin/python bench/read_path_live.py        # qwen2.5-32b twin, 1024 tokens, 16 req
  sudo .venv/bin/python bench/read_path_live.py --profiles kvscope-serial,kvscope --concurrency 1,8
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("examples:")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="stock,kvscope-serial,kvscope",
                        help="comma list of kvscope run profiles; ratios are to the last one")
    parser.add_argument("--model", default="qwen2.5-32b")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--out", type=Path, default=Path("runs/read_path_live"),
                        help="one run directory per profile is created under it")
    parser.add_argument("--port", type=int, default=8231)
    parser.add_argument("--json", help="also write the table to this JSON file")
    return parser.parse_args(argv)


def _kvscope_run(args: argparse.Namespace, profile: str, out: Path, *options: str) -> None:
    """One ``kvscope run`` (ValueError naming the run on failure)."""
    argv = [sys.executable, "-m", "kvscope.cli", "run", "--model", args.model,
            "--profile", profile, "--requests", str(args.requests),
            "--prompt-tokens", str(args.prompt_tokens), "--out", str(out),
            "--port", str(args.port), "--no-probes", "--no-tracing", *options]
    print(f"{profile}: {' '.join(argv[3:])}", flush=True)
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(f"kvscope run for profile {profile} failed (exit {proc.returncode}); "
                         f"see {out}/server.log\n{proc.stderr[-2000:]}")


def _run(args: argparse.Namespace, profile: str) -> pd.DataFrame:
    """Warm run, then a true cold start on its chunks; the cold requests."""
    out = args.out / f"{time.strftime('%Y%m%d-%H%M%S')}-{profile}"
    kv_dir = out / "kv"
    _kvscope_run(args, profile, out / "warm", "--phases", "warm,cold", "--concurrency", "1",
                 "--kv-dir", str(kv_dir), "--keep-kv")
    _kvscope_run(args, profile, out / "cold", "--phases", "cold",
                 "--concurrency", args.concurrency, "--kv-dir", str(kv_dir))  # removes kv_dir
    from kvscope.contract import rundir

    requests = rundir.read_table(out / "cold", "requests")
    cold = requests.assign(profile=profile)
    failed = cold[cold["status"] != "ok"]
    if len(failed):
        raise ValueError(f"{profile}: {len(failed)} cold requests failed in {out}")
    return cold


def _table(cold: pd.DataFrame, profiles: list[str]) -> pd.DataFrame:
    """TTFT median / p99 per concurrency (rows) and profile (columns), with ratios."""
    stats = cold.groupby(["concurrency", "profile"])["ttft_s"].agg(
        p50="median", p99=lambda s: s.quantile(0.99), hit_tokens="size")
    stats["hit_tokens"] = cold.groupby(["concurrency", "profile"])["cached_tokens"].mean()
    wide = stats.unstack("profile")
    base = profiles[-1]
    for p in profiles[:-1]:
        for q in ("p50", "p99"):
            wide[(f"{q} x", f"{p}/{base}")] = wide[(q, p)] / wide[(q, base)]
    return wide


def _print(wide: pd.DataFrame, profiles: list[str], load: tuple[str, str]) -> None:
    base = profiles[-1]
    print(f"\ncold TTFT (s), median and p99; ratios = profile / {base} (> 1: {base} faster)")
    ttft = {f"{p} {q}": wide[(q, p)] for p in profiles for q in ("p50", "p99")}
    ratios = {f"{p}/{base} {q}": wide[(f"{q} x", f"{p}/{base}")]
              for p in profiles[:-1] for q in ("p50", "p99")}
    print(pd.DataFrame(ttft).round(3).to_string())
    print(pd.DataFrame(ratios).round(2).to_string())
    print("mean cached tokens per cold request:")
    print(wide["hit_tokens"][profiles].round(0).to_string())
    print(f"load average before: {load[0]}; after: {load[1]}")


def main(argv: Optional[list[str]] = None) -> int:
    """Run every profile, print the table; 0, or 2 when a run fails."""
    args = _parse(argv)
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        cold = pd.concat([_run(args, p) for p in profiles])
    except ValueError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return 2
    after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    wide = _table(cold, profiles)
    _print(wide, profiles, (before, after))
    if args.json:
        flat = wide.copy()
        flat.columns = [" ".join(c) for c in flat.columns]
        Path(args.json).write_text(json.dumps(flat.reset_index().to_dict("records"), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
