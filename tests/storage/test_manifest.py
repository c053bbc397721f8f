"""storage/manifest.py: runs, fingerprints and versions, on plain values (no config model)."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest

from eagle_data.errors import EagleDataError, OutputMismatch
from eagle_data.storage.contract import MANIFEST_VERSION
from eagle_data.storage.manifest import Manifest


def test_a_run_is_recorded_with_its_config_and_counts(tmp_path):
    manifest = Manifest(pafs.LocalFileSystem(), str(tmp_path))
    run = manifest.start_run("prompts", {"output": {"max_attempts": 5}}, {"prompt_config": {"source.sample": 3}})
    manifest.finish_run("prompts", run, {"prompts": 3})
    again = Manifest(pafs.LocalFileSystem(), str(tmp_path))
    assert again.exists and again.max_attempts == 5
    stored = json.loads((tmp_path / "manifest.json").read_text())
    assert stored["schema_version"] == MANIFEST_VERSION
    [recorded] = stored["phases"]["prompts"]["runs"]
    assert recorded["status"] == "complete" and recorded["config"] == {"output": {"max_attempts": 5}}
    assert stored["phases"]["prompts"]["counts"] == {"prompts": 3}  # the phase's totals


def test_a_changed_fingerprint_is_refused_naming_the_keys(tmp_path):
    manifest = Manifest(pafs.LocalFileSystem(), str(tmp_path))
    manifest.start_run("prompts", {}, {"prompt_config": {"source.sample": 3, "source.seed": 0}})
    manifest.check_config("prompts", {"source.sample": 3, "source.seed": 0})  # same: fine
    with pytest.raises(OutputMismatch, match="source.seed"):
        manifest.check_config("prompts", {"source.sample": 3, "source.seed": 1})


@pytest.mark.parametrize("version, says", [(2, "older eagle-data"), (MANIFEST_VERSION + 1, "upgrade")])
def test_another_schema_version_is_refused_with_what_to_do(tmp_path, version, says):
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": version, "phases": {}}))
    with pytest.raises(EagleDataError, match=says):
        Manifest(pafs.LocalFileSystem(), str(tmp_path))


def test_a_manifest_json_of_another_tool_is_not_ours(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "someone else's"}))
    manifest = Manifest(pafs.LocalFileSystem(), str(tmp_path))
    assert manifest.foreign and not manifest.exists


def test_a_key_recorded_only_on_one_side_is_named_only_when_its_value_changed(tmp_path):
    # The prompt config holds sampling.seed only with variants: adding variants must not name
    # the seed, which the run's whole config shows was the same; a changed seed is named.
    manifest = Manifest(pafs.LocalFileSystem(), str(tmp_path))
    manifest.start_run("prompts", {"sampling": {"seed": 0, "variants": []}},
                       {"prompt_config": {"sampling.variants": []}})
    with pytest.raises(OutputMismatch, match=r"\(changed: sampling\.variants\)"):
        manifest.check_config("prompts", {"sampling.variants": [{"name": "a"}], "sampling.seed": 0})
    with pytest.raises(OutputMismatch, match=r"\(changed: sampling\.seed, sampling\.variants\)"):
        manifest.check_config("prompts", {"sampling.variants": [{"name": "a"}], "sampling.seed": 1})
