"""Which settings make each phase's fingerprint: a rerun on the same OUT with a different
value of one of these keys would mix rows made two ways, so it is refused (naming the
keys). Settings that only change how fast rows are made (batch sizes, replicas) are not
in them. Flattened `section.key` dicts, as the manifest stores them (JSON-normalised).
"""

from __future__ import annotations

from eagle_data.config import Config
from eagle_data.storage.manifest import normalised


def prompt_config(cfg: Config) -> dict:
    """The keys that decide prompts/ and skipped/."""
    return normalised({
        # per_source only when set, so OUTs made before it existed still match.
        **{f"source.{k}": v for k, v in cfg.source.model_dump().items()
           if k != "per_source" or v is not None},
        **{f"prompt.{k}": v for k, v in cfg.prompt.model_dump().items()},
        "model.tokenizer": cfg.model.tokenizer_path,
        "model.reasoning_start": cfg.model.reasoning_start,
        "model.reasoning_end": cfg.model.reasoning_end,
        "engine.max_model_len": cfg.engine.max_model_len,
        "sampling.max_tokens": cfg.sampling.max_tokens,
        # The conversations and their variants (drawn with sampling.seed when there are several).
        "sampling.answers_per_prompt": cfg.sampling.answers_per_prompt,
        "sampling.variants": [v.model_dump() for v in cfg.sampling.variants],
        **({"sampling.seed": cfg.sampling.seed} if cfg.sampling.variants else {}),
    })


def generate_config(cfg: Config) -> dict:
    """The keys that decide the content of data/."""
    return normalised({
        "model.path": cfg.model.path,
        **{f"sampling.{k}": v for k, v in cfg.sampling.model_dump().items()},
        "mask.train_on": cfg.mask.train_on,
    })


def hidden_states_config(cfg: Config) -> dict:
    """The keys that decide the content of hidden_states/ (layer_ids null = the model's default)."""
    return normalised({
        "model.path": cfg.model.path,
        **{f"hidden_states.{k}": v for k, v in cfg.hidden_states.model_dump().items()
           if k in ("layer_ids", "dtype", "finish_reason", "source")},
    })
