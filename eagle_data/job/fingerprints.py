"""Which settings make each phase's fingerprint: a rerun on the same OUT with a different
value of one of these keys would mix rows made two ways, so it is refused (naming the
keys). The keys are the settings tagged `changes(<phase>)` in config.py; RUN_ONLY ones
(batch sizes, replicas) are in none. Flattened `section.key` dicts, as the manifest stores
them (JSON-normalised).
"""

from __future__ import annotations

from eagle_data.config import Config, phases_changed, settings
from eagle_data.storage.manifest import normalised


def _tagged(cfg: Config, phase: str) -> dict:
    """`section.key: value` of every setting tagged as changing `phase`, in field order."""
    found = {}
    values = cfg.model_dump()
    for key, field in settings():
        if phase in (phases_changed(field) or ()):
            value = values
            for part in key.split("."):
                value = value[part]
            found[key] = value
    return found


def prompt_config(cfg: Config) -> dict:
    """The keys that decide prompts/ and skipped/."""
    config = _tagged(cfg, "prompts")
    # The tokenizer the prompts phase used: model.path when model.tokenizer is null.
    config["model.tokenizer"] = cfg.model.tokenizer_path
    # per_source, fields and answers only when set, so OUTs made before they existed still match.
    if cfg.source.per_source is None:
        del config["source.per_source"]
    if cfg.source.fields is None:
        del config["source.fields"]
    if cfg.prompt.answers == "target":
        del config["prompt.answers"]
    # sampling.seed reaches prompts/ only by drawing each conversation's variant, so only with variants.
    if not cfg.sampling.variants:
        del config["sampling.seed"]
    return normalised(config)


# What decides how the target samples, not what the dataset's answers are.
SAMPLED_ONLY = ("sampling.temperature", "sampling.top_p", "sampling.top_k", "sampling.min_p", "sampling.seed",
                "sampling.logprobs", "sampling.logprobs_dtype")


def generate_config(cfg: Config) -> dict:
    """The keys that decide the content of data/: with the dataset's answers (prompt.answers)
    not the sampling keys, which decide nothing there; prompt.answers only when it is
    `dataset`, so OUTs made before it existed still match."""
    config = _tagged(cfg, "generate")
    if cfg.prompt.answers == "target":
        del config["prompt.answers"]
    else:
        config = {k: v for k, v in config.items() if k not in SAMPLED_ONLY}
    return normalised(config)


def hidden_states_config(cfg: Config) -> dict:
    """The keys that decide the content of hidden_states/ (layer_ids null = the model's default)."""
    return normalised(_tagged(cfg, "hidden_states"))
