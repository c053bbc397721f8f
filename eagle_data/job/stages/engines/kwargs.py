"""The engine's kwargs: typed config keys own some, `engine.engine_kwargs` passes the rest through."""

from __future__ import annotations

from typing import Any

from eagle_data.errors import ConfigError


def refuse_owned(typed: dict[str, tuple[str, Any]], passed: dict) -> None:
    """A pass-through engine kwarg that a typed key owns is refused: it would go over the
    typed value, which the prompts phase and the tokenizer use (`typed` is what the
    backend's builder sets, {kwarg: (owning key, value)}, so the two cannot drift)."""
    for kwarg in passed:
        if kwarg in typed:
            raise ConfigError(f"engine.engine_kwargs.{kwarg}: set {typed[kwarg][0]} instead "
                              "(the job uses that value elsewhere too)")


def with_passed(typed: dict[str, tuple[str, Any]], passed: dict) -> dict:
    """A builder's kwargs: what the typed keys set (None: not passed, the library's default),
    then the pass-through ones, none of which may be one a typed key owns."""
    refuse_owned(typed, passed)
    return {**{k: v for k, (_, v) in typed.items() if v is not None}, **passed}
