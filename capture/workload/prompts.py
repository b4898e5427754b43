"""Deterministic prompts as token ids: the server gets exactly the prompt length asked for.

Token ids skip the tokenizer and vLLM's characters-per-token guard on text prompts; the twins'
word-level tokenizer still turns the output back into text.
"""

from __future__ import annotations

import random

from kvscope.capture import twins


def make_prompts(
    count: int, tokens: int, *, vocab_size: int, seed: int, shared_prefix_tokens: int = 0
) -> list[list[int]]:
    """`count` prompts of exactly `tokens` tokens; the first `shared_prefix_tokens` are shared."""
    if not 0 <= shared_prefix_tokens <= tokens:
        raise ValueError(
            f"shared prefix of {shared_prefix_tokens} tokens does not fit prompts of {tokens}"
        )
    first = len(twins.SPECIAL_TOKENS)
    rng = random.Random(seed)
    prefix = [rng.randrange(first, vocab_size) for _ in range(shared_prefix_tokens)]
    prompts = []
    for _ in range(count):
        rest = [rng.randrange(first, vocab_size) for _ in range(tokens - shared_prefix_tokens)]
        prompts.append(prefix + rest)
    return prompts
