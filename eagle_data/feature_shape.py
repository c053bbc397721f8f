"""The target's feature shape: what its EAGLE-3 features are made of, from its config
(model_files.model_config): its decoder layers L, its hidden size H, and the layer ids whose
states are taken (`hidden_states.layer_ids`, or EAGLE-3's default; ids go from 0, the
embeddings, to L, the final state). The hidden-states phase, the feature stream, the draft
trainer and the acceptance job read it here; the draft trainer reads it once per run
(`feature_shape`) and hands it on.
"""

from __future__ import annotations

import dataclasses

from eagle_data.config import Config
from eagle_data.errors import ConfigError, MissingInput
from eagle_data.model_files import model_config, text_config_value


@dataclasses.dataclass(frozen=True)
class FeatureShape:
    """One read of the target's config: L, H, its vocabulary (None where the config has none)
    and the layer ids of the features, the last one the final state."""

    num_layers: int
    hidden_size: int
    vocab_size: int | None
    layer_ids: tuple[int, ...]

    @property
    def aux_layer_ids(self) -> list[int]:
        """The draft's aux layers: every layer id but the final state (speculators' target_layer_ids)."""
        return list(self.layer_ids[:-1])


def feature_shape(cfg: Config) -> FeatureShape:
    """The target's config read once: its shape and the layer ids `cfg` asks for."""
    config, where = target_config(cfg)
    num_layers, hidden_size = layers_and_hidden_size(config, where)
    vocab = text_config_value(config, "vocab_size")
    return FeatureShape(num_layers, hidden_size, int(vocab) if vocab else None, tuple(layer_ids(cfg, num_layers)))


def target_shape(cfg: Config) -> tuple[int, int]:
    """(decoder layers L, hidden size H) of the target, from its config."""
    return layers_and_hidden_size(*target_config(cfg))


def target_config(cfg: Config) -> tuple[dict, str]:
    """The target's config (model.path's), and where it was read."""
    config, where = model_config(cfg.model.path, cfg.model.trust_remote_code)
    if config is None:
        raise MissingInput(f"model.path {cfg.model.path!r}: the target's config (its layers and hidden size, "
                           f"for the hidden states) cannot be read: {where}")
    return config, where


def layers_and_hidden_size(config: dict, where: str) -> tuple[int, int]:
    layers, hidden = text_config_value(config, "num_hidden_layers"), text_config_value(config, "hidden_size")
    if not layers or not hidden:
        raise MissingInput(f"{where} has no num_hidden_layers / hidden_size")
    return int(layers), int(hidden)


def layer_ids(cfg: Config, num_layers: int) -> list[int]:
    """hidden_states.layer_ids (sorted), or EAGLE-3's default for a target of `num_layers`."""
    ids = cfg.hidden_states.layer_ids
    if ids is None:
        return eagle3_layer_ids(num_layers)
    too_deep = [k for k in ids if k > num_layers]
    if too_deep:
        raise ConfigError(f"hidden_states.layer_ids {too_deep} exceed the target's {num_layers} layers "
                          f"(ids go from 0, the embeddings, to {num_layers}, the final state)")
    return sorted(ids)


def eagle3_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's choice (speculators', SpecForge's and Model-Optimizer's, as vLLM ids): the
    states after decoder layers 2, L/2 and L-3, and the final one (L); fewer on a model
    too shallow for four distinct ones."""
    return sorted({min(max(k, 1), num_layers) for k in (2, num_layers // 2, num_layers - 3, num_layers)})
