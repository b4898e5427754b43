"""What `kvscope demo` studies, as options: kept apart from the study so that building the CLI's
parser (its defaults come from here) imports no pandas or vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvscope.capture.workload.profiles import PEERS
from kvscope.contract.study_roles import BASELINE, CANDIDATE, CLASSIC

ORDERS = ("abba", "random")


@dataclass
class StudyOptions:
    out: Path
    model: str = "qwen2.5-32b"
    profiles: list[str] = field(default_factory=lambda: [BASELINE, CLASSIC, CANDIDATE, "stock",
                                                         *PEERS])
    requests: int = 16
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 16])
    prompt_tokens: int = 1024
    port: int = 8000
    models_dir: Path | None = None
    kv_dir_base: Path | None = None  # chunk files go to <base>/kv-<profile or warm group>
    device: str = "disk"  # or twin:<profile> (capture/workload/device.py)
    share_warm: bool = True  # profiles of one chunk format share one warm phase
    repeats: int = 3  # runs of each profile, in interleaved blocks (kvscope.study.block_orders)
    order: str = "abba"  # or "random": how the blocks after the first are ordered
    seed: int = 0  # the random order's seed, recorded in study.json
    command: list[str] = field(default_factory=list)
