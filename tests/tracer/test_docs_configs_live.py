"""The LMCache configuration docs/gpu-host.md shows, run as written on the CPU stack.

Only `kvscope.path` is changed (to a test directory); the model is the tiny twin.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from user_server import complete, tiny_prompts, user_server

from kvscope.workload import system
from kvscope.workload.runner import expected_chunks, wait_for_stores

pytestmark = [pytest.mark.live, pytest.mark.root]
DOC = Path(__file__).parents[2] / "docs" / "gpu-host.md"


def _section_yaml(title: str) -> dict:
    text = DOC.read_text()
    section = text[text.index(title):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, f"no yaml block under {title!r} in {DOC}"
    return yaml.safe_load(block.group(1))


def test_the_by_hand_lmcache_yaml_gives_a_disk_tier_that_serves_hits(tmp_path):
    config = _section_yaml("## 3. A real model, by hand")
    config["extra_config"]["kvscope.path"] = str(tmp_path / "kv")
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(config))
    prompts = tiny_prompts(2, seed=31)
    with user_server(tmp_path / "server", env={"LMCACHE_CONFIG_FILE": str(path)}) as server:
        for prompt in prompts:
            complete(server, prompt, max_tokens=1)
        assert wait_for_stores(tmp_path / "kv", expected_chunks(prompts)) == expected_chunks(
            prompts), "the disk tier stored every chunk"
        system.drop_page_cache()
        cached = [complete(server, p, max_tokens=1)["usage"] for p in prompts]
        log = server.config.log_path.read_text(errors="replace")
    assert "Failed to create backend" not in log
    assert all((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) >= 512
               for u in cached), cached
