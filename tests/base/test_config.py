import pytest

from eagle_data.config import load_config
from eagle_data.errors import ConfigError

BASE = ["model.path=/m", "output.path=/o"]


def test_defaults_and_overrides_are_typed():
    cfg = load_config(None, BASE + ["source.sample=100", "sampling.temperature=0",
                                    "prompt.chat_template_kwargs={enable_thinking: false}",
                                    "engine.backend=transformers", "source.sample=null"])
    assert cfg.source.sample is None
    assert cfg.sampling.temperature == 0.0
    assert cfg.prompt.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.model.tokenizer_path == "/m"
    assert cfg.engine.replica_resources == {}
    assert load_config(None, BASE + ["engine.replica_resources={eagle_replica: 1}"]).engine.replica_resources \
        == {"eagle_replica": 1}


def test_yaml_file_plus_set(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: /m}\noutput: {path: /o}\nsampling: {max_tokens: 10}\n")
    cfg = load_config(f, ["sampling.max_tokens=20"])
    assert cfg.sampling.max_tokens == 20


@pytest.mark.parametrize("override, message", [
    ("source.smaple=3", "source.smaple: unknown key"),
    ("engine.replicas=two", "engine.replicas: Input should be a valid integer"),
    ("engine.backend=tgi", "engine.backend: Input should be 'vllm' or 'transformers'"),
    ("mask.train_on=all", "mask.train_on: Input should be 'generated' or 'response'"),
    ("sampling.max_tokens=20000", "sampling.max_tokens (20000) must be smaller than engine.max_model_len (16384)"),
    ("output.rows_per_shard=0", "output.rows_per_shard: Input should be greater than or equal to 1"),
    ("engine.replica_resources={GPU: 8}", "engine.replica_resources takes custom resources only, not GPU"),
    ("engine.replica_resources={eagle_replica: 0}", "engine.replica_resources.eagle_replica: Input should be greater than 0"),
])
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + [override])
    assert message in str(e.value)


def test_missing_required_key_and_bad_set_syntax():
    with pytest.raises(ConfigError, match="output: required key is missing"):
        load_config(None, ["model.path=/m"])
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(None, BASE + ["sampling.max_tokens"])
    with pytest.raises(ConfigError, match="model.path is not a section"):
        load_config(None, BASE + ["model.path.x=1"])


def test_transformers_backend_refuses_tensor_parallel():
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 needs engine.backend=vllm"):
        load_config(None, BASE + ["engine.backend=transformers", "engine.tensor_parallel_size=2"])
