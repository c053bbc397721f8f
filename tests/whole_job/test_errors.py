"""Errors a user understands: a one-line message and a non-zero exit, before any work."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from support import REPO, SAMPLE, job_cli, job_settings, write_jsonl
from eagle_data.errors import EagleDataError, NotAnOut
from eagle_data.reader import OutReader


def test_tools_refuse_a_folder_that_is_not_an_out(tmp_path):
    (tmp_path / "data").mkdir()
    for command in ("verify", "report", "inspect"):
        for path in (tmp_path, tmp_path / "typo"):
            result = subprocess.run([sys.executable, "-m", "eagle_data", command, str(path)],
                                    cwd=REPO, capture_output=True, text=True)
            assert result.returncode == 2, (command, result.stderr)
            assert result.stderr.strip().splitlines()[-1].startswith(f"error: not an eagle-data OUT: {path}")
    assert not (tmp_path / "typo").exists() and not (tmp_path / "report.json").exists()
    with pytest.raises(NotAnOut):
        OutReader(str(tmp_path / "typo"))


def test_an_unsupported_dataset_file_stops_the_job_before_it_starts(tmp_path, qwen3_tokenizer_dir):
    (tmp_path / "rows.csv").write_text("a,b\n1,2\n")
    config = tmp_path / "job.yaml"
    out = tmp_path / "out"
    config.write_text(yaml.safe_dump(job_settings(out, qwen3_tokenizer_dir, tmp_path / "rows.csv")))
    result = job_cli(config, "--phase", "prompts")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: source.dataset")
    assert "unsupported file type" in result.stderr and "Traceback" not in result.stderr
    assert not (out / "manifest.json").exists()  # nothing recorded as running


def test_reader_pad_id_before_the_generate_phase_says_what_to_do(ray_local, tmp_path, qwen3_tokenizer_dir):
    from eagle_data.job.phases.run import run
    from support import as_config

    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": [{"role": "user", "content": "Hi?"}]}])
    run(as_config(job_settings(tmp_path / "out", qwen3_tokenizer_dir, path)), phase="prompts")
    with pytest.raises(EagleDataError, match="no generate phase yet"):
        OutReader(str(tmp_path / "out")).pad_id


def test_missing_paths_fail_at_once_without_hub_retries(tmp_path, qwen3_tokenizer_dir):
    (tmp_path / "data").mkdir()
    config = tmp_path / "job.yaml"
    # A relative dataset path under a local folder is local: missing means missing.
    config.write_text(yaml.safe_dump(job_settings(tmp_path / "out", qwen3_tokenizer_dir, "data/nope.jsonl")))
    result = job_cli(config, "--phase", "prompts", cwd=tmp_path)
    assert result.returncode == 2 and "error: source.dataset 'data/nope.jsonl' does not exist" in result.stderr
    # A model id that looks like the hub's, with no hub: the cache only, a miss fails at once.
    config.write_text(yaml.safe_dump(job_settings(tmp_path / "out", "nobody/no-such-model", SAMPLE)))
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    result = job_cli(config, "--phase", "prompts", env=env)
    assert result.returncode == 2, result.stderr
    assert "hub is unreachable: using the local HF cache only for nobody/no-such-model" in result.stderr
    assert "error: cannot load the tokenizer from model.tokenizer/model.path 'nobody/no-such-model'" in result.stderr


@pytest.mark.slow  # a job process that asks the unreachable hub: ~20 s
def test_a_hub_dataset_without_the_hub_is_a_message_not_a_traceback(tmp_path, qwen3_tokenizer_dir):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_settings(tmp_path / "out", qwen3_tokenizer_dir, "nobody/no-such-dataset")))
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    result = job_cli(config, "--phase", "prompts", env=env)
    assert result.returncode == 2, result.stderr
    assert "hub is unreachable: using the local HF cache only for source.dataset nobody/no-such-dataset" in result.stderr
    assert "error: source.dataset 'nobody/no-such-dataset' (split 'train') cannot be loaded" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out" / "manifest.json").exists()
