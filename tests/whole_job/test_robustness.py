"""Never destroy what is not ours, never exit 0 on a wrong result, errors instead of
tracebacks, integrity beyond the footer (issue 13, the OUT side)."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import yaml

from support import REPO, SAMPLE, attached, job_cli, job_config, job_settings, read, shards
from eagle_data.config import load_config
from eagle_data.errors import ConfigError, EagleDataError, OutputLocked
from eagle_data.job.phases.run import run
from eagle_data.storage.contract import is_ours
from eagle_data.storage.folder import Output
from eagle_data.storage.lock import lock
from eagle_data.tools.verify import verify


def user_files(root: Path) -> dict[str, str]:
    files = {"data/train.jsonl": '{"messages": []}\n', "failed/important.log": "keep me\n",
             "manifest.json": '{"mine": true}\n', "notes.txt": "hello\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return files


def test_empty_output_path_is_refused():
    with pytest.raises(ConfigError, match="output.path"):
        load_config(None, ["model.path=/m", "output.path="])


def test_what_is_ours_is_only_what_the_project_writes():
    shard = "part-20261130T083052-39a5c6-00001.parquet"
    ours = ["manifest.json", ".lock", "report.json", "report.html", "report/lengths.png", f"data/{shard}",
            f"prompts/{shard}", f"quarantine/failed/{shard}", ".staging/x.parquet", "vocab/d2t.pt"]
    theirs = ["notes.txt", "data/train.jsonl", "data/part-00000.parquet", f"data/sub/{shard}",
              "failed/important.log", "report/report.pdf", f"quarantine/{shard}", f"other/{shard}"]
    assert all(is_ours(p) for p in ours) and not any(is_ours(p) for p in theirs)


@pytest.mark.parametrize("fresh", [True, False])
def test_a_folder_with_files_not_ours_is_refused_and_untouched(tmp_path, qwen3_tokenizer_dir, fresh):
    out = tmp_path / "out"
    files = user_files(out)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_settings(out, qwen3_tokenizer_dir)))
    result = job_cli(config, "--phase", "prompts", *(["--fresh"] if fresh else []))
    assert result.returncode == 2, result.stderr
    assert "holds files eagle-data did not write (data/train.jsonl, failed/important.log, manifest.json, notes.txt)" \
        in result.stderr and "Traceback" not in result.stderr
    assert {p: (out / p).read_text() for p in files} == files  # nothing deleted or overwritten
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(files)


def test_output_path_dot_in_a_users_folder_is_refused(tmp_path, qwen3_tokenizer_dir):
    scratch = tmp_path / "scratch"
    (scratch / "data").mkdir(parents=True)
    (scratch / "data" / "mine.jsonl").write_text("{}\n")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_settings(".", qwen3_tokenizer_dir)))
    result = job_cli(config, "--phase", "prompts", "--fresh", cwd=scratch)
    assert result.returncode == 2 and "data/mine.jsonl" in result.stderr
    assert (scratch / "data" / "mine.jsonl").read_text() == "{}\n"


def test_a_dataset_inside_out_is_refused(tmp_path, qwen3_tokenizer_dir):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(EagleDataError, match="not write|inside output.path"):
        run(job_config(out, qwen3_tokenizer_dir, shutil.copy(SAMPLE, out / "rows.jsonl")), phase="prompts")
    (tmp_path / "out2" / "vocab").mkdir(parents=True)  # a folder of ours that takes any file
    with pytest.raises(EagleDataError, match="is inside output.path"):
        run(job_config(tmp_path / "out2", qwen3_tokenizer_dir, shutil.copy(SAMPLE, tmp_path / "out2" / "vocab")),
            phase="prompts")


def test_unreachable_object_store_output_is_a_message(tmp_path, qwen3_tokenizer_dir):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_settings("s3://eagle-data-no-such-bucket-x1/out", qwen3_tokenizer_dir)))
    result = job_cli(config, "--phase", "prompts")
    assert result.returncode == 2 and "error: output.path 's3://eagle-data-no-such-bucket-x1/out' cannot be" \
        in result.stderr and "Traceback" not in result.stderr


def _take_lock(path: str, barrier, results) -> None:
    barrier.wait()
    try:
        with lock(Output(path)):
            results.put("locked")
            barrier.wait()  # hold it until both have tried
            return
    except OutputLocked:
        results.put("refused")
    barrier.wait()


def test_the_lock_is_taken_atomically(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for trial in range(10):
        path = str(tmp_path / f"out{trial}")
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_take_lock, args=(path, barrier, results)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert sorted(results.get(timeout=5) for _ in procs) == ["locked", "refused"], trial
        assert not os.path.exists(f"{path}/.lock")


def test_a_dead_runs_lock_is_taken_over_with_a_message(tmp_path, caplog):
    out = Output(str(tmp_path / "out"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".lock").write_text(
        f'{{"pid": {dead.stdout.strip()}, "host": "{os.uname().nodename}", "started": "earlier"}}')
    with caplog.at_level("WARNING", logger="eagle_data"), lock(out):
        assert str(os.getpid()) in (tmp_path / "out" / ".lock").read_text()
    assert any("taking over the lock" in r.getMessage() and dead.stdout.strip() in r.getMessage()
               for r in caplog.records)


def _flip_bytes_in_a_data_page(shard: Path, column: str) -> None:
    meta = pq.read_metadata(shard)
    names = [meta.row_group(0).column(i).path_in_schema for i in range(meta.num_columns)]
    chunk = meta.row_group(0).column(names.index(f"{column}.list.element"))
    start, size = chunk.data_page_offset, chunk.total_compressed_size
    data = bytearray(shard.read_bytes())
    for at in (start + size - 9, start + size - 5):  # inside the page's data, past its header
        data[at] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_truncated_or_flipped_shard_is_quarantined_and_regenerated(ray_local, tmp_path, tiny_qwen3):
    """Two data shards damaged behind the job's back, one cut in half, one with bytes flipped
    inside a data page (its footer intact: only the page checksums see it): `verify` names
    both and its command exits 1; the next run moves both to quarantine/, answers their rows
    again and only them, and the greedy rows are what they were. Readers see only good shards."""
    cfg = job_config(tmp_path / "out", tiny_qwen3, source__sample=12, output__rows_per_shard=4)
    out = tmp_path / "out"
    run(cfg)
    before = {r["sample_id"]: r["input_ids"] for r in read(out, "data")}
    flipped, truncated = shards(out, "data")[:2]
    lost = {r["sample_id"] for victim in (truncated, flipped) for r in pq.read_table(victim).to_pylist()}
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    _flip_bytes_in_a_data_page(flipped, "input_ids")

    problems, _ = verify(str(out))
    for victim in (truncated, flipped):
        assert any(victim.name in p and "unreadable shard" in p for p in problems), \
            (victim.name, [p[-300:] for p in problems])
    result = subprocess.run([sys.executable, "-m", "eagle_data", "verify", str(out)],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 1 and "unreadable shard" in result.stderr

    again = run(cfg)["generate"]
    for victim in (truncated, flipped):
        assert not victim.exists() and (out / "quarantine" / "data" / victim.name).exists()
    problems, counts = verify(str(out))
    assert problems == [] and again["ok"] == counts["ok"] == len(before)
    runs = json.loads((out / "manifest.json").read_text())["phases"]["generate"]["runs"]
    assert runs[-1]["todo"] == len(lost)
    assert {r["sample_id"]: r["input_ids"] for r in read(out, "data")} == before  # greedy: the same rows
    assert pads.dataset(shards(out, "data")).count_rows() == len(before)


def test_a_flipped_bit_only_the_page_checksum_sees_is_named_by_verify_and_refused_by_the_reader(small_out, tmp_path,
                                                                                                  capsys):
    """One bit flipped inside the input_ids values of a data shard where the page still
    decodes (pyarrow reads it back without error, with a changed token): only the page's
    checksum sees it. `verify` names the shard, as the run's own check at start does
    (storage/damage.py), instead of passing an OUT whose tokens changed; a trainer's reader
    and `export` (which reads through it) refuse it, naming the shard, instead of serving the
    changed token."""
    from eagle_data.__main__ import main
    from eagle_data.errors import DamagedShard
    from eagle_data.reader import Samples
    from eagle_data.storage.damage import read_problem
    from eagle_data.storage.folder import Output

    out = Path(shutil.copytree(small_out, tmp_path / "out"))
    victim = shards(out, "data")[0]
    good = victim.read_bytes()
    meta = pq.read_metadata(victim)
    names = [meta.row_group(0).column(i).path_in_schema for i in range(meta.num_columns)]
    chunk = meta.row_group(0).column(names.index("input_ids.list.element"))
    fs = Output.existing(str(out)).fs
    tokens = pq.read_table(victim).column("input_ids").to_pylist()
    for at in range(chunk.data_page_offset, chunk.data_page_offset + chunk.total_compressed_size):
        data = bytearray(good)
        data[at] ^= 0x01
        victim.write_bytes(bytes(data))
        try:
            changed = pq.read_table(victim).column("input_ids").to_pylist() != tokens
        except Exception:  # the page no longer decodes: any reader sees that
            continue
        if changed and read_problem(fs, str(victim)):
            break
    else:
        pytest.fail("no bit of this shard's input_ids page decodes to other tokens: the test has nothing to flip")
    problems, _ = verify(str(out))
    assert any(victim.name in p and "unreadable shard" in p and "checksum" in p.lower() for p in problems), problems
    with pytest.raises(DamagedShard, match=f"{re.escape(victim.name)} cannot be read .*checksum.*a damaged shard"):
        [item["input_ids"] for item in Samples(str(out), shuffle=False)]
    assert main(["export", str(out), str(tmp_path / "x.jsonl"), "--format", "jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and victim.name in err and "checksum" in err.lower(), err


def test_a_deleted_prompts_shard_is_rebuilt(ray_local, tmp_path, qwen3_tokenizer_dir):
    cfg = job_config(tmp_path / "out", qwen3_tokenizer_dir, source__sample=20, output__rows_per_shard=4)
    out = tmp_path / "out"
    first = run(cfg, phase="prompts")["prompts"]
    before = sorted(r["sample_id"] for r in read(out, "prompts"))
    shards(out, "prompts")[1].unlink()
    assert run(cfg, phase="prompts")["prompts"] == first
    assert sorted(r["sample_id"] for r in read(out, "prompts")) == before
    assert verify(str(out))[0] == []


def test_tools_report_what_a_half_finished_out_holds(ray_local, tmp_path, qwen3_tokenizer_dir):
    out = tmp_path / "out"
    run(job_config(out, qwen3_tokenizer_dir, source__sample=10), phase="prompts")
    problems, counts = verify(str(out))
    assert problems == [] and counts["prompts"] + counts["skipped"] == 10 and not counts["generate_finished"]
    for command in ("report", "inspect"):
        result = subprocess.run([sys.executable, "-m", "eagle_data", command, str(out)], cwd=REPO,
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    assert "ok 0" in result.stdout


def test_a_report_that_cannot_be_written_does_not_fail_complete_data(ray_local, tmp_path, qwen3_tokenizer_dir,
                                                                      monkeypatch, caplog):
    import eagle_data.job.phases.run as job_run

    def full_disk(out):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(job_run, "write_report", full_disk)
    with caplog.at_level("WARNING", logger="eagle_data"):
        counts = run(job_config(tmp_path / "out", qwen3_tokenizer_dir, source__sample=6), phase="prompts")
    assert counts["prompts"]["selected"] == 6
    assert any("data is complete, but its report could not be written" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), ValueError("\\notacommand\n^"),
                                   EagleDataError("report.html is a FIFO")])
def test_no_report_error_after_complete_data_fails_the_job(tmp_path, monkeypatch, caplog, error):
    """The issue: a `$\\x$` source made the report raise matplotlib's ParseFatalException (a
    ValueError), which only OSError and ArrowException were caught for: the job exited 1 after
    complete data. Any error making the report after a phase is a warning naming it."""
    import eagle_data.job.phases.run as job_run
    from support import synthetic_row, write_out

    def failing(out):
        raise error

    monkeypatch.setattr(job_run, "write_report", failing)
    out = write_out(tmp_path / "out", [synthetic_row(0, 2, 0, 1, "stop", "a")], rows_per_shard=1)
    with caplog.at_level("WARNING", logger="eagle_data"):
        job_run.report(Output(str(out)))
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "data is complete, but its report could not be written" in warning
    assert f"{type(error).__name__}: {error}" in warning and f"python -m eagle_data report {out}" in warning


@pytest.mark.slow
def test_a_full_disk_is_a_message_and_the_rerun_resumes(ray_local, tmp_path, small_disk, qwen3_tokenizer_dir):
    out = small_disk / "out"
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_settings(out, qwen3_tokenizer_dir, output__rows_per_shard=5)))
    filler = small_disk / "filler"
    free = shutil.disk_usage(small_disk).free
    filler.write_bytes(b"\0" * (free - 48 * 1024))  # room for the manifest, not for the prompts
    result = job_cli(config, "--phase", "prompts", env=attached(ray_local))
    assert result.returncode == 4, result.stderr
    assert "error: no space left on device" in result.stderr and "Traceback" not in result.stderr
    filler.unlink()
    again = job_cli(config, "--phase", "prompts", env=attached(ray_local))
    assert again.returncode == 0, again.stderr
    assert verify(str(out))[0] == []


@pytest.mark.slow
def test_rows_of_another_out_or_config_are_never_taken_as_this_outs(ray_local, tmp_path, tiny_qwen3, caplog):
    """A data shard copied in from another OUT is quarantined and its samples made again; a
    lost manifest.json with a changed sampling config is refused (the old rows would be
    labelled with the new config); a damaged one is rebuilt from the shards' footers,
    keeping every row and the damaged file."""
    from eagle_data.errors import OutputMismatch
    from eagle_data.storage.contract import OUT_ID_KEY

    cfg = job_config(tmp_path / "out", tiny_qwen3, source__sample=6, output__rows_per_shard=3)
    out = tmp_path / "out"
    run(cfg)
    out_id = Output(str(out)).manifest.out_id
    victim = shards(out, "data")[0]
    table = pq.read_table(victim)  # the same samples, as another OUT's job wrote them
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, OUT_ID_KEY.encode(): b"0" * 32}), victim)
    assert any(victim.name in p and "written for another OUT" in p for p in verify(str(out))[0])
    with caplog.at_level("WARNING", logger="eagle_data"):
        again = run(cfg)["generate"]
    assert (out / "quarantine" / "data" / victim.name).exists()
    assert any(victim.name in r.getMessage() and "written for another OUT" in r.getMessage() for r in caplog.records)
    runs = Output(str(out)).manifest.runs("generate")
    assert runs[-1]["todo"] == table.num_rows and again["ok"] == again["prompts"] == len(read(out, "data"))
    assert verify(str(out))[0] == []

    manifest = (out / "manifest.json").read_bytes()
    data = sorted(p.name for p in shards(out, "data"))
    (out / "manifest.json").unlink()
    hot = job_config(tmp_path / "out", tiny_qwen3, source__sample=6, output__rows_per_shard=3, sampling__temperature=0.7)
    with pytest.raises(OutputMismatch, match=r"generate rows \(data/, failed/, stopped/\) made with different settings \(changed: sampling.temperature\)"):
        run(hot)
    assert sorted(p.name for p in shards(out, "data")) == data and not (out / "manifest.json").exists()

    (out / "manifest.json").write_bytes(manifest[:300])  # cut short
    assert run(cfg)["generate"]["ok"] == len(read(out, "data"))
    rebuilt = Output(str(out)).manifest
    assert rebuilt.out_id == out_id and rebuilt.runs("generate")[-1]["todo"] == 0  # every row kept
    assert sorted(p.name for p in shards(out, "data")) == data
    [kept] = (out / "quarantine").glob("manifest-*.json")
    assert kept.read_bytes() == manifest[:300]
    assert verify(str(out))[0] == []


@pytest.mark.slow
def test_several_answers_per_prompt_are_not_taken_for_a_damaged_prompts_phase(ray_local, tmp_path, tiny_qwen3,
                                                                             caplog):
    """prompts/ holds a row per conversation (prompts x answers_per_prompt): compared with the
    recorded `prompts` count, every later run took the phase for damaged, refused
    `--phase generate`, failed verify, and `all` remade the prompts on every resume."""
    out = tmp_path / "out"
    cfg = job_config(out, tiny_qwen3, source__sample=3, sampling__answers_per_prompt=2, sampling__max_tokens=4,
                     engine__batch_size=4)
    run(cfg, phase="prompts")
    assert len(read(out, "prompts")) == 6
    result = run(cfg, phase="generate")["generate"]
    assert result["ok"] == 6
    run(cfg, phase="all")
    manifest = Output(str(out)).manifest
    assert manifest.status("prompts") == "complete" and len(manifest.runs("prompts")) == 1
    assert "making the prompts again" not in caplog.text
    assert verify(str(out))[0] == []
