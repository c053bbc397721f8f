"""The transformers hidden-states pass loads the model as the generate pass does (issue 55,
case 11): `engine.engine_kwargs` reach its `from_pretrained` (it passed only the dtype, so
a `revision:` used for generation gave features of another model with no warning), with
the pass's own dtype. A `variant` stands in for a revision: the same choice of weights,
on a local folder."""

from __future__ import annotations

import shutil

import pytest
import torch

from support import job_config
from eagle_data.job.stages.engines import transformers_hidden_states
from eagle_data.job.stages.engines.transformers_hidden_states import TransformersHiddenStates, from_pretrained_kwargs


def test_the_pass_hands_the_engine_kwargs_to_its_actors_with_its_own_dtype(monkeypatch, tmp_path):
    passed = {}
    monkeypatch.setattr(transformers_hidden_states, "actor_pool", lambda ds, cfg, engine, size, **kw: passed.update(kw))
    kwargs = {"revision": "abc123", "attn_implementation": "eager", "torch_dtype": "bfloat16"}
    cfg = job_config(tmp_path / "out", tmp_path / "model", engine__engine_kwargs=kwargs)
    transformers_hidden_states.transformers_hidden_states_stage(None, cfg, [1, 2], "float32")
    assert passed["engine_kwargs"] == kwargs and passed["dtype"] == "float32"
    assert from_pretrained_kwargs(kwargs, "float32") == {"revision": "abc123", "attn_implementation": "eager",
                                                         "dtype": torch.float32}
    assert from_pretrained_kwargs({"dtype": "float16"}, "bfloat16") == {"dtype": torch.bfloat16}


def test_a_variant_of_the_weights_is_the_one_the_states_come_from(tiny_qwen3, tmp_path):
    """Real loads of the tiny Qwen3: the folder holds its weights and, as variant `alt`, other
    ones; with `variant: alt` in the engine kwargs the pass computes the alt model's states."""
    from transformers import AutoModelForCausalLM

    model = shutil.copytree(tiny_qwen3, tmp_path / "model")
    alt = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        for p in alt.parameters():
            p.mul_(1.5)
    alt.save_pretrained(model, variant="alt")
    only_alt = shutil.copytree(tiny_qwen3, tmp_path / "only-alt")
    alt.save_pretrained(only_alt)
    ids = [9707, 11, 1879, 0, 358, 1079]
    states = {name: TransformersHiddenStates(str(folder), False, [1, 2], "float32", engine_kwargs=kwargs).states(ids)
              for name, folder, kwargs in [("default", model, {}), ("alt", model, {"variant": "alt"}),
                                           ("want", only_alt, {})]}
    assert torch.equal(states["alt"], states["want"])
    assert not torch.allclose(states["alt"], states["default"])


@pytest.mark.parametrize("kwargs", [{"torch_dtype": "bfloat16"}, {"dtype": "float16"}])
def test_the_engines_dtype_gives_way_to_the_pass_dtype(tiny_qwen3, kwargs):
    engine = TransformersHiddenStates(str(tiny_qwen3), False, [1, 2], "float32", engine_kwargs=kwargs)
    assert engine.model.dtype == torch.float32
