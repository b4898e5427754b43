"""What one `kvscope run` does, as options: kept apart from the driver so that building the CLI's
parser (its defaults come from here) imports no pandas, aiohttp or vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvscope.capture.device_twin import Twin


@dataclass
class RunOptions:
    out: Path
    model: str = "qwen2.5-32b"
    models_dir: Path = Path.home() / ".cache" / "kvscope" / "models"
    profile: str = "stock"
    requests: int = 8
    concurrency: list[int] = field(default_factory=lambda: [4])
    prompt_tokens: int = 1024
    shared_prefix_tokens: int = 0
    max_tokens: int = 4
    phases: list[str] = field(default_factory=lambda: ["warm", "cold"])
    warm_concurrency: int = 1
    kv_dir: Path | None = None
    copy_kv_dir: Path | None = None  # a write-only kvscope tier there stores every chunk too
    peer_copies: dict[str, Path] = field(default_factory=dict)  # chunk format -> a tier there
    keep_kv: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    seed: int = 0
    kv_cache_gib: int | None = None
    probes: bool = True
    tracing: bool = True
    command: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    device: str = "disk"  # or twin:<profile> (capture/workload/device.py)
    twin: "Twin | None" = None  # the twin `device` names, when the caller holds it (a study)
