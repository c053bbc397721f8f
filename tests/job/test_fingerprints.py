"""job/fingerprints.py: the three phase configs a rerun on the same OUT is checked against.
The expected dicts are literal: they are what OUTs made so far store in their manifest, so
a change here refuses every existing OUT."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from eagle_data import config_doc
from eagle_data.config import RUN_ONLY, changes, load_config, phases_changed, settings
from eagle_data.job.fingerprints import generate_config, hidden_states_config, prompt_config

BASE = ["model.path=/m", "output.path=/o"]

PROMPTS = {
    "source.dataset": "mlabonne/open-perfectblend", "source.split": "train", "source.sample": None,
    "source.seed": 0,
    "prompt.turns": "first_user", "prompt.max_turns": None, "prompt.chat_template_kwargs": {},
    "model.tokenizer": "/m", "model.reasoning_start": "<think>", "model.reasoning_end": "</think>",
    "engine.max_model_len": 16384,
    "sampling.max_tokens": 8192, "sampling.answers_per_prompt": 1, "sampling.variants": [],
}
GENERATE = {
    "model.path": "/m",
    "sampling.max_tokens": 8192, "sampling.temperature": 0.6, "sampling.top_p": 0.95, "sampling.top_k": 0,
    "sampling.min_p": 0.0, "sampling.seed": 0, "sampling.variants": [], "sampling.answers_per_prompt": 1,
    "sampling.logprobs": 0, "sampling.logprobs_dtype": "float32",
    "mask.train_on": "generated",
}
HIDDEN_STATES = {
    "model.path": "/m",
    "hidden_states.layer_ids": None, "hidden_states.dtype": "bfloat16", "hidden_states.finish_reason": None,
    "hidden_states.source": None,
}

VARIANT = {"name": None, "weight": 1.0, "max_tokens": None, "temperature": None, "top_p": None, "top_k": None,
           "min_p": None, "chat_template_kwargs": None}
VARIANTS = [{**VARIANT, "name": "short", "weight": 2.0, "max_tokens": 64},
            {**VARIANT, "name": "nothink", "chat_template_kwargs": {"enable_thinking": False}}]

CASES = {
    "defaults": ([], PROMPTS, GENERATE, HIDDEN_STATES),
    # With variants the prompt config holds sampling.seed too: it draws each conversation's variant.
    "variants": (
        ["model.tokenizer=/t", "sampling.seed=7", "sampling.answers_per_prompt=2",
         "sampling.variants=[{name: short, max_tokens: 64, weight: 2}, "
         "{name: nothink, chat_template_kwargs: {enable_thinking: false}}]"],
        {**PROMPTS, "model.tokenizer": "/t", "sampling.answers_per_prompt": 2, "sampling.variants": VARIANTS,
         "sampling.seed": 7},
        {**GENERATE, "sampling.seed": 7, "sampling.answers_per_prompt": 2, "sampling.variants": VARIANTS},
        HIDDEN_STATES),
    "per_source": (
        ["source.sample=10", "source.per_source={max_rows: 3, weights: {'*': 1, a: 0.5}}", "prompt.turns=all",
         "prompt.max_turns=2", "prompt.chat_template_kwargs={enable_thinking: true}"],
        {**PROMPTS, "source.sample": 10, "source.per_source": {"max_rows": 3, "weights": {"*": 1.0, "a": 0.5}},
         "prompt.turns": "all", "prompt.max_turns": 2, "prompt.chat_template_kwargs": {"enable_thinking": True}},
        GENERATE, HIDDEN_STATES),
    # Speed-only settings (batch sizes, shard sizes, replicas, enabled) are in no fingerprint.
    "hidden_states": (
        ["hidden_states.enabled=true", "hidden_states.layer_ids=[1, 3]", "hidden_states.dtype=float32",
         "hidden_states.finish_reason=[stop]", "hidden_states.source=[s1]", "hidden_states.rows_per_shard=5",
         "sampling.logprobs=4", "sampling.logprobs_dtype=float16", "mask.train_on=response",
         "engine.batch_size=3", "engine.replicas=2", "output.rows_per_shard=7", "output.log_every_s=5"],
        PROMPTS,
        {**GENERATE, "sampling.logprobs": 4, "sampling.logprobs_dtype": "float16", "mask.train_on": "response"},
        {**HIDDEN_STATES, "hidden_states.layer_ids": [1, 3], "hidden_states.dtype": "float32",
         "hidden_states.finish_reason": ["stop"], "hidden_states.source": ["s1"]}),
    # The dataset's own answers: recorded in both (only then, so that OUTs made before the key
    # still match); data/ is then decided by no sampling key but max_tokens (where an answer is cut).
    "dataset answers": (
        ["prompt.answers=dataset", "source.fields={user: question, assistant: answer}", "sampling.temperature=0"],
        {**PROMPTS, "prompt.answers": "dataset",
         "source.fields": {"user": "question", "assistant": "answer", "system": None, "source": "source"}},
        {"model.path": "/m", "prompt.answers": "dataset", "sampling.max_tokens": 8192, "sampling.variants": [],
         "sampling.answers_per_prompt": 1, "mask.train_on": "generated"},
        HIDDEN_STATES),
}


@pytest.mark.parametrize("case", CASES)
def test_phase_configs_are_the_ones_existing_outs_store(case):
    sets, prompts, generate, hidden_states = CASES[case]
    cfg = load_config(None, BASE + sets)
    assert prompt_config(cfg) == prompts
    assert generate_config(cfg) == generate
    assert hidden_states_config(cfg) == hidden_states


def test_every_setting_says_which_phases_it_changes():
    untagged = [key for key, field in settings() if phases_changed(field) is None]
    assert untagged == [], (
        f"{', '.join(untagged)}: say in config.py whether it changes a phase's rows "
        "(json_schema_extra=changes(\"prompts\"/\"generate\"/\"hidden_states\")) or not (RUN_ONLY)")


def test_the_settings_cover_every_key_of_every_section():
    keys = {key for key, _ in settings()}
    assert {"source.per_source", "sampling.variants", "engine.batch_size"} <= keys
    for dotted, _, model in config_doc.sections():
        for name in model.model_fields:
            # A key of a section held in a setting (source.per_source.max_rows) is part of its value.
            key = f"{dotted}.{name}"
            assert key in keys or any(key.startswith(k + ".") for k in keys), key


def test_an_untagged_field_is_named_at_any_depth():
    class Inner(BaseModel):
        tagged: int = Field(json_schema_extra=changes("generate"), default=0)
        forgotten: int = 0

    class Outer(BaseModel):
        inner: Inner = Field(default_factory=Inner)
        held: list[Inner] = Field(json_schema_extra=RUN_ONLY, default_factory=list)

    found = {key: phases_changed(field) for key, field in settings(Outer)}
    assert found == {"inner.tagged": ["generate"], "inner.forgotten": None, "held": []}
    with pytest.raises(ValueError, match="phases are"):
        changes("generat")


def test_switching_an_out_between_the_targets_and_the_datasets_answers_is_refused_naming_the_key(tmp_path):
    """Either way round: the key is recorded in the fingerprints only as `dataset`, so a
    switch back shows as a key recorded on one side only."""
    from eagle_data.errors import OutputMismatch
    from eagle_data.storage.manifest import Manifest
    from eagle_data.storage.files import filesystem

    target = load_config(None, BASE)
    dataset = load_config(None, BASE + ["prompt.answers=dataset"])
    for made, then in [(target, dataset), (dataset, target)]:
        fs, root = filesystem(str(tmp_path / f"out-{made.prompt.answers}"))
        manifest = Manifest(fs, root)
        for phase, config in (("prompts", prompt_config), ("generate", generate_config)):
            manifest.start_run(phase, made.model_dump(mode="json"), {f"{'prompt' if phase == 'prompts' else phase}_config":
                                                                     config(made)})
            with pytest.raises(OutputMismatch, match=r"made with different settings \(changed: prompt.answers"):
                manifest.check_config(phase, config(then))
