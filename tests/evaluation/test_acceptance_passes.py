"""acceptance.path, the acceptance job's own folder (evaluation/report_folder.py), and its kept
passes (evaluation/passes.py), on real files: what is the job's own, what a rerun reuses and
what it measures again. The whole job's kill and rerun: tests/evaluation/test_acceptance_job.py."""

from __future__ import annotations

import json
import shutil

import pytest

from support import job_config
from eagle_data.errors import ForeignFiles, cli
from eagle_data.evaluation import passes, report_folder

ROWS = [{"sample_id": "p0", "source": "s", "temperature": 0.0, "generated_tokens": [1, 2], "engine_started": 1.0,
         "engine_finished": 2.0, "spec_accepted": [1], "spec_drafted": [3]}]


def test_the_jobs_own_temporary_files_are_its_own_and_removed_at_start(tmp_path):
    """A full disk while the report was written left `.report.json.tmp` (0 bytes): its message
    says to rerun the same command, which was then refused as "files the acceptance job did
    not write". They are the job's, removed at start; anything else is still refused."""
    folder = tmp_path / "report"
    report_folder.prepare(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["passes"]
    left = [".report.json.tmp", ".acceptance.png.tmp", ".per_prompt.jsonl.tmp", "passes/.target.json.tmp"]
    for name in left:
        (folder / name).write_bytes(b"")
    (folder / "report.json").write_text("{}")
    (folder / "passes" / "target.json").write_text("{}")
    report_folder.prepare(str(folder))
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == ["passes", "passes/target.json",
                                                                            "report.json"]
    for foreign in ["notes.tmp", ".notes.tmp", "passes/notes.txt", "passes/.hidden.json"]:
        (folder / foreign).write_text("a user's")
        with pytest.raises(ForeignFiles, match=f"did not write \\({foreign}\\)"):
            report_folder.prepare(str(folder))
        assert (folder / foreign).read_text() == "a user's"
        (folder / foreign).unlink()


def test_a_full_disk_while_a_pass_is_kept_says_to_rerun_and_the_rerun_is_not_refused(small_disk, capsys):
    """A real full disk (a 1 MiB tmpfs, filled) while a pass is written: `cli`'s one line,
    exit 4, "rerun the same command"; the pass's temporary file is left, and the rerun's check
    takes it for the job's own (was: refused as a file the job did not write)."""
    folder = small_disk / "report"
    report_folder.prepare(str(folder))
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * shutil.disk_usage(small_disk).free)

    def job() -> int:
        passes.keep(str(folder), "target", {}, ROWS * 100, 1.0)
        return 0

    assert cli(job, writing=lambda: str(folder)) == 4
    said = capsys.readouterr().err
    assert said.startswith(f"error: no space left on device writing {folder} (") and "rerun the same command" in said
    assert (folder / "passes" / ".target.json.tmp").exists() and not (folder / "passes" / "target.json").exists()
    filler.unlink()
    report_folder.prepare(str(folder))  # the rerun
    assert sorted(p.name for p in (folder / "passes").iterdir()) == []


def test_a_kept_pass_is_reused_under_the_same_settings_and_measured_again_when_one_changed(tmp_path, tiny_qwen3, caplog):
    folder = tmp_path / "report"
    report_folder.prepare(str(folder))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    (draft / "model.safetensors").write_bytes(b"12345678")

    def decided(**overrides):
        cfg = job_config(tmp_path / "prompts", tiny_qwen3, acceptance__drafts={"d": str(draft)},
                         acceptance__path=str(folder), **overrides)
        return passes.settings(cfg, passes.prompts_digest(["p0"], [[5, 6]]), [7], str(draft))

    name = passes.pass_name("d")
    assert passes.kept(str(folder), name, decided(), "draft d") is None  # none yet
    passes.keep(str(folder), name, decided(), ROWS, 3.0)
    caplog.set_level("INFO", logger="eagle_data")
    assert passes.kept(str(folder), name, decided(), "draft d") == ROWS
    assert "draft d: reusing the pass finished at" in caplog.text
    assert passes.kept(str(folder), name, decided(acceptance__temperatures=[0.0, 0.7]), "draft d") is None
    assert "measuring it again, its settings changed since" in caplog.text and "(acceptance.temperatures)" in caplog.text
    (draft / "model.safetensors").write_bytes(b"123456789")  # the checkpoint written again
    assert passes.kept(str(folder), name, decided(), "draft d") is None
    assert "(draft files)" in caplog.text
    assert passes.kept(str(folder), name, passes.settings(
        job_config(tmp_path / "prompts", tiny_qwen3, acceptance__path=str(folder)),
        passes.prompts_digest(["p0"], [[5, 7]]), [7], str(draft)), "draft d") is None
    assert "draft files, prompts" in caplog.text
    (folder / "passes" / f"{name}.json").write_text('{"settings": {')  # damaged since: measured again
    assert passes.kept(str(folder), name, decided(), "draft d") is None
    assert "cannot be read" in caplog.text
    # Feeding settings decide no row: a pass is reused whatever they are.
    passes.keep(str(folder), name, decided(), ROWS, 3.0)
    assert passes.kept(str(folder), name, decided(engine__batch_size=32, engine__replicas=2), "draft d") == ROWS
    assert json.loads((folder / "passes" / f"{name}.json").read_text())["rows"] == ROWS
    assert passes.pass_name("a/b c") != passes.pass_name("a_b_c") and "/" not in passes.pass_name("a/b c")
