"""KV-geometry twins: local models whose KV cache is byte-for-byte a real model's in size and
shape, while their compute is small enough for a 2-core CPU.

The KV cache size per token depends only on layers x KV heads x head_dim x dtype, so a twin
with the real values there and a tiny hidden size stores, reads and moves exactly the bytes the
real model would. Twins use Llama's architecture with QKV bias (what Qwen2 is) because vLLM's
Qwen2 derives head_dim from the hidden size, while Llama honours an explicit head_dim.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvscope.contract import files

MARKER = "kvscope-twin.json"
CHUNK_TOKENS = 256  # LMCache's default chunk size
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class TwinSpec:
    """A real model's KV geometry plus the small compute part that stands in for the rest."""

    name: str
    twin_of: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str = "bfloat16"
    seed: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_chunk(self) -> int:
        return self.kv_bytes_per_token * CHUNK_TOKENS

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


TWINS: dict[str, TwinSpec] = {
    spec.name: spec
    for spec in (
        TwinSpec("qwen2.5-32b", "Qwen/Qwen2.5-32B", num_layers=64, num_kv_heads=8, head_dim=128,
                 num_attention_heads=8, hidden_size=256, intermediate_size=512,
                 vocab_size=4096, max_position_embeddings=32768),
        TwinSpec("qwen2.5-7b", "Qwen/Qwen2.5-7B", num_layers=28, num_kv_heads=4, head_dim=128,
                 num_attention_heads=4, hidden_size=256, intermediate_size=512,
                 vocab_size=4096, max_position_embeddings=32768),
        TwinSpec("tiny", "(none: a small model for fast tests)", num_layers=2, num_kv_heads=2,
                 head_dim=64, num_attention_heads=2, hidden_size=128, intermediate_size=256,
                 vocab_size=1024, max_position_embeddings=4096),
    )
}


class UnknownTwinError(ValueError):
    pass


def get(name: str) -> TwinSpec:
    try:
        return TWINS[name]
    except KeyError:
        raise UnknownTwinError(
            f"unknown twin {name!r}; choose one of: {', '.join(TWINS)}"
        ) from None


def describe(spec: TwinSpec) -> str:
    return (
        f"{spec.name:<12} twin of {spec.twin_of}: {spec.num_layers} layers, "
        f"{spec.num_kv_heads} KV heads, head_dim {spec.head_dim}, {spec.dtype}: "
        f"{_human(spec.kv_bytes_per_token)} per token, "
        f"{_human(spec.kv_bytes_per_chunk)} per {CHUNK_TOKENS}-token chunk"
    )


def word(token_id: int) -> str:
    """The text of a non-special token: one whitespace-separated word per token."""
    return f"w{token_id}"


def is_made(spec: TwinSpec, directory: Path) -> bool:
    marker = Path(directory) / MARKER
    return marker.exists() and json.loads(marker.read_text()).get("fingerprint") == spec.fingerprint()


def make(spec: TwinSpec, directory: str | Path) -> tuple[Path, bool]:
    """Write the twin into directory (weights, config, tokenizer); reuse it if already there.

    Returns the directory and whether it was written now.
    """
    directory = Path(directory)
    if is_made(spec, directory):
        return directory, False
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Two processes asking for the same twin (parallel tests, two demos) take turns: the second
    # finds it made instead of rewriting files the first one's server may be reading.
    with files.locked(directory.parent / f".{directory.name}.lock"):
        if is_made(spec, directory):
            return directory, False
        if directory.exists() and any(directory.iterdir()) and not (directory / MARKER).exists():
            raise FileExistsError(
                f"{directory} exists and is not a kvscope twin; pick an empty or new directory"
            )
        directory.mkdir(exist_ok=True)
        _write_tokenizer(spec, directory)
        _write_weights(spec, directory)
        marker = {"fingerprint": spec.fingerprint(), "spec": asdict(spec)}
        files.atomic_write(directory / MARKER, json.dumps(marker, indent=2),
                           files.OUTPUT_FILE_MODE)
    return directory, True


def _write_weights(spec: TwinSpec, directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        attention_bias=True,
        tie_word_embeddings=True,
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        torch_dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(directory, safe_serialization=True)


def _write_tokenizer(spec: TwinSpec, directory: Path) -> None:
    """A word-level tokenizer: prompt of N words = exactly N tokens, no hub access."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): i for i in range(len(SPECIAL_TOKENS), spec.vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=spec.max_position_embeddings,
    )
    fast.save_pretrained(directory)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:g} {unit}" if unit == "B" else f"{size:.4g} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
