"""Twins have the real models' KV geometry, are deterministic, and tokenise one word per token."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from kvscope.capture import twins
from kvscope.capture.workload.prompts import make_prompts


@pytest.mark.parametrize(("name", "per_token", "per_chunk"), [
    ("qwen2.5-32b", 256 * 1024, 64 * 2**20),
    ("qwen2.5-7b", 56 * 1024, 14 * 2**20),
    ("tiny", 1024, 256 * 1024),
])
def test_kv_bytes_match_the_real_geometry(name, per_token, per_chunk):
    spec = twins.get(name)
    assert spec.kv_bytes_per_token == per_token
    assert spec.kv_bytes_per_chunk == per_chunk


def test_unknown_twin_lists_the_choices():
    with pytest.raises(twins.UnknownTwinError, match="choose one of: qwen2.5-32b"):
        twins.get("llama-9000")


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_twin_is_deterministic_and_reused(tmp_path):
    spec = twins.get("tiny")
    first, made_first = twins.make(spec, tmp_path / "a")
    second, made_second = twins.make(spec, tmp_path / "b")
    again, made_again = twins.make(spec, tmp_path / "a")
    assert made_first and made_second and not made_again
    assert _digest(first) == _digest(second)
    config = json.loads((first / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 64


def test_two_processes_asking_for_one_twin_make_it_once(tmp_path):
    """Parallel test workers (and two demos) ask for the same twin at once: one writes it, the
    other waits and reuses it, never rewriting files a server may already be reading."""
    code = ("import sys; from kvscope.capture import twins; "
            "print(twins.make(twins.get('tiny'), sys.argv[1])[1])")
    makers = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "tiny")],
                               stdout=subprocess.PIPE, text=True) for _ in range(2)]
    made = sorted(p.communicate(timeout=300)[0].strip() for p in makers)
    assert [p.returncode for p in makers] == [0, 0]
    assert made == ["False", "True"]
    assert twins.is_made(twins.get("tiny"), tmp_path / "tiny")


def test_twin_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a kvscope twin"):
        twins.make(twins.get("tiny"), tmp_path / "x")


def test_prompts_have_exact_lengths_shared_prefix_and_no_special_tokens():
    spec = twins.get("tiny")
    ids = make_prompts(3, 300, vocab_size=spec.vocab_size, seed=1, shared_prefix_tokens=256)
    assert all(len(i) == 300 for i in ids)
    assert ids[0][:256] == ids[1][:256] == ids[2][:256]
    assert ids[0][256:] != ids[1][256:]
    assert min(min(i) for i in ids) >= len(twins.SPECIAL_TOKENS)
    assert max(max(i) for i in ids) < spec.vocab_size
    assert make_prompts(3, 300, vocab_size=spec.vocab_size, seed=1, shared_prefix_tokens=256) == ids
    with pytest.raises(ValueError, match="does not fit"):
        make_prompts(1, 10, vocab_size=spec.vocab_size, seed=1, shared_prefix_tokens=11)


def test_tokenizer_round_trips_words(tmp_path):
    from transformers import AutoTokenizer

    path, _ = twins.make(twins.get("tiny"), tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("w7 w8 w1023")["input_ids"]
    assert ids == [7, 8, 1023]
    assert tokenizer.decode(ids) == "w7 w8 w1023"
