"""Sampling variants and answers per prompt: which conversations a prompt becomes, and how
each one is answered (docs/variants.md).

A prompt (`prompt_id`, the hash of what the target is asked) becomes
`sampling.answers_per_prompt` conversations; each conversation draws one variant by
weight from a hash of its id and `sampling.seed`, so the assignment depends on nothing
but the config and the data: the same on any machine, layout or resume. The prompts phase
makes the assignment and renders each conversation with its variant's chat-template
arguments; prompts/ records it, and every later step reads it from there.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from dataclasses import dataclass
from fractions import Fraction
from itertools import accumulate
from math import lcm

from eagle_data.config import Config, VariantConfig

DEFAULT = "default"  # the one variant of a config without sampling.variants
ANSWER_SEPARATOR = "."  # <prompt_id>.<answer> when answers_per_prompt > 1
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p")


@dataclass(frozen=True)
class Variant:
    name: str
    weight: float
    sampling: dict  # SAMPLING_KEYS -> the value sent to the engine
    chat_template_kwargs: dict  # prompt.chat_template_kwargs with the variant's over them
    max_prompt_tokens: int  # engine.max_model_len - its max_tokens: the longest prompt that leaves room

    @property
    def renders_as(self) -> tuple:
        """What decides how a conversation is rendered: variants equal here share one rendering."""
        return frozen(self.chat_template_kwargs), self.max_prompt_tokens


def frozen(value) -> tuple:
    """A hashable key for a JSON-like value (the chat-template arguments: lists such as
    Qwen3's `tools`, nested mappings, YAML's other scalars): equal exactly when the values
    are, types included (`1` and `true` are not one rendering); dict order does not count."""
    if isinstance(value, dict):
        return "dict", tuple(sorted((frozen(k), frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return "list", tuple(frozen(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return type(value).__name__, repr(value)
    return type(value).__name__, value


def variants(cfg: Config) -> dict[str, Variant]:
    """The config's variants by name (one, `default`, without sampling.variants)."""
    s = cfg.sampling
    found = {}
    for spec in s.variants or [VariantConfig(name=DEFAULT)]:
        sampling = {k: getattr(s, k) if getattr(spec, k) is None else getattr(spec, k) for k in SAMPLING_KEYS}
        kwargs = {**cfg.prompt.chat_template_kwargs, **(spec.chat_template_kwargs or {})}
        found[spec.name] = Variant(spec.name, spec.weight, sampling, kwargs,
                                   cfg.engine.max_model_len - sampling["max_tokens"])
    return found


def conversation_ids(prompt_id: str, answers: int) -> list[str]:
    """A prompt's conversations: the prompt id itself for one answer, `<id>.<n>` for several."""
    if answers == 1:
        return [prompt_id]
    return [f"{prompt_id}{ANSWER_SEPARATOR}{n}" for n in range(answers)]


class Assigner:
    """A conversation's variant: drawn by weight from blake2b(seed, conversation id).

    In exact integer arithmetic: every finite positive float is an integer over a power of
    two, so the cumulative weights are integers over their common denominator and the
    draw compares `digest / 2**64` with `bound / total` exactly. Float sums overflowed
    (two weights of 1e308: every conversation went to the last variant) or lost the
    smallest weights (subnormals)."""

    def __init__(self, found: dict[str, Variant], seed: int):
        self.names = list(found)
        ratios = [Fraction(v.weight) for v in found.values()]
        denominator = lcm(*(r.denominator for r in ratios))
        self.bounds = [b << 64 for b in accumulate(r.numerator * (denominator // r.denominator) for r in ratios)]
        self.total = self.bounds[-1] >> 64
        self.seed = seed

    def __call__(self, conversation_id: str) -> str:
        if len(self.names) == 1:
            return self.names[0]
        digest = hashlib.blake2b(f"{self.seed}:{conversation_id}".encode(), digest_size=8).digest()
        # the first variant whose bound / total exceeds digest / 2**64
        u = int.from_bytes(digest, "big") * self.total
        return self.names[min(bisect_right(self.bounds, u), len(self.names) - 1)]
