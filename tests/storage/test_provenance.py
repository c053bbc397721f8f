"""Where rows came from (storage/provenance.py): every shard's footer names its OUT, run and
config fingerprint; a job quarantines shards of another OUT or config, rebuilds a lost or
damaged manifest.json from the footers, and --fresh deletes everything the project wrote.
Real Parquet files on a local folder, without Ray."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_data.errors import EagleDataError, NotAnOut, OutputMismatch
from eagle_data.storage.contract import (FINGERPRINT_KEY, OUT_ID_KEY, PROMPTS_SCHEMA, RUN_KEY,
                                         is_ours)
from eagle_data.storage.damage import quarantine_corrupt
from eagle_data.storage.folder import Output
from eagle_data.storage.manifest import fingerprint
from eagle_data.storage.provenance import keep_rebuilt, rebuild_manifest
from eagle_data.storage.shards import read_provenance, shard_files

PROMPT_CONFIG = {"source.sample": 3, "source.seed": 0}
GENERATE_CONFIG = {"sampling.temperature": 0.0, "model.path": "tiny"}
IDS = pa.schema([("sample_id", pa.string())])


def make_out(path, prompt_config=PROMPT_CONFIG, generate_config=GENERATE_CONFIG, ids=("a", "b")) -> Output:
    """An OUT as the job leaves it: a prompts and a generate run, one shard each."""
    out = Output(str(path))
    run = out.manifest.start_run("prompts", {}, {"status": "running", "prompt_config": prompt_config})
    write(out, "prompts", run["run_id"], PROMPTS_SCHEMA, ids)
    out.manifest.mark("prompts", "complete")
    out.manifest.finish_run("prompts", run, {"prompts": len(ids)})
    run = out.manifest.start_run("generate", {}, {"generate_config": generate_config})
    write(out, "data", run["run_id"], IDS, ids)
    out.manifest.finish_run("generate", run, {"ok": len(ids)})
    return Output(str(path))


def write(out: Output, folder: str, run_id: str, schema: pa.Schema, ids) -> None:
    rows = pa.table({name: [None] * len(ids) for name in schema.names}, schema=schema)
    rows = rows.set_column(0, "sample_id", pa.array(ids, pa.string()))
    writer = out.writer(folder, schema, run_id, rows_per_shard=100)
    writer.add(rows)
    writer.close()


def test_every_shard_footer_names_its_out_run_and_phase_config(tmp_path):
    out = make_out(tmp_path / "out")
    [prompts] = shard_files(out.fs, out.folder("prompts"))
    [data] = shard_files(out.fs, out.folder("data"))
    found = read_provenance(out.fs, data)
    assert found[OUT_ID_KEY] == out.manifest.out_id and len(out.manifest.out_id) == 32
    assert found[RUN_KEY] == out.manifest.runs("generate")[-1]["run_id"] and found[RUN_KEY] in data
    assert found[FINGERPRINT_KEY] == fingerprint(GENERATE_CONFIG)
    assert read_provenance(out.fs, prompts)[FINGERPRINT_KEY] == fingerprint(PROMPT_CONFIG) != fingerprint(GENERATE_CONFIG)
    assert pq.read_table(data).column("sample_id").to_pylist() == ["a", "b"]  # the rows themselves unchanged


def test_a_shard_of_another_out_or_config_or_without_a_footer_is_quarantined(tmp_path, caplog):
    out = make_out(tmp_path / "out")
    other = make_out(tmp_path / "other", ids=("a", "b", "c"))  # same config, another OUT
    changed = make_out(tmp_path / "changed", generate_config={**GENERATE_CONFIG, "sampling.temperature": 1.0})
    [own] = shard_files(out.fs, out.folder("data"))
    [copied] = shard_files(other.fs, other.folder("data"))
    shutil.copy(copied, out.folder("data"))
    # Same OUT (out_id), rows made under another generate config: the manifest's says otherwise.
    [alien] = shard_files(changed.fs, changed.folder("data"))
    table = pq.read_table(alien)
    metadata = {**table.schema.metadata, OUT_ID_KEY.encode(): out.manifest.out_id.encode()}
    pq.write_table(table.replace_schema_metadata(metadata), f"{out.folder('data')}/part-20260101T000000-aaaaaa-00000.parquet")
    pq.write_table(pa.table({"sample_id": ["z"]}), f"{out.folder('data')}/part-20260101T000000-bbbbbb-00000.parquet")
    with caplog.at_level("WARNING", logger="eagle_data"):
        moved = quarantine_corrupt(out)
    assert sorted(p.rsplit("/", 1)[1] for p in moved) == sorted(
        [copied.rsplit("/", 1)[1], "part-20260101T000000-aaaaaa-00000.parquet", "part-20260101T000000-bbbbbb-00000.parquet"])
    assert shard_files(out.fs, out.folder("data")) == [own]
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert f"written for another OUT (out_id {other.manifest.out_id}" in said
    assert f"made under another generate config (fingerprint {fingerprint({**GENERATE_CONFIG, 'sampling.temperature': 1.0})}" in said
    assert "its footer names no OUT" in said
    assert len(shard_files(out.fs, out.folder("quarantine/data"))) == 3


def test_a_lost_manifest_is_rebuilt_from_the_footers_and_a_changed_config_refused(tmp_path):
    made = make_out(tmp_path / "out")
    (tmp_path / "out" / "manifest.json").unlink()
    with pytest.raises(NotAnOut, match="holds eagle-data shards: rerun the job with the config that made this OUT"):
        Output.existing(str(tmp_path / "out"))
    out = Output(str(tmp_path / "out"))
    assert rebuild_manifest(out)
    assert out.manifest.out_id == made.manifest.out_id
    out.manifest.check_config("prompts", PROMPT_CONFIG)  # the config that made them: accepted
    out.manifest.check_config("generate", GENERATE_CONFIG)
    with pytest.raises(OutputMismatch, match=r"generate rows \(data/, failed/, stopped/\) made with different settings \(changed: sampling.temperature\)"):
        out.manifest.check_config("generate", {**GENERATE_CONFIG, "sampling.temperature": 0.7})
    assert not out.manifest.finished("prompts")  # made again, with its counts
    keep_rebuilt(out)
    again = Output.existing(str(tmp_path / "out"))
    assert again.manifest.out_id == made.manifest.out_id and quarantine_corrupt(again) == []  # every shard kept


def test_a_damaged_manifest_is_named_so_and_rebuilt_keeping_the_file_in_quarantine(tmp_path):
    make_out(tmp_path / "out")
    path = tmp_path / "out" / "manifest.json"
    cut = path.read_bytes()[:100]
    path.write_bytes(cut)
    out = Output(str(tmp_path / "out"))
    assert out.manifest.damaged and not out.manifest.foreign
    out.check_ours()  # ours, damaged: not "a file eagle-data did not write"
    with pytest.raises(EagleDataError, match="manifest.json is damaged \\(JSONDecodeError.*rebuilds manifest.json from "
                                             "the shards' footers and keeps the data"):
        Output.existing(str(tmp_path / "out"))
    assert rebuild_manifest(out)
    keep_rebuilt(out)
    [kept] = (tmp_path / "out" / "quarantine").glob("manifest-*.json")
    assert kept.read_bytes() == cut and is_ours(f"quarantine/{kept.name}")
    assert Output.existing(str(tmp_path / "out")).manifest.phase_config("generate") == GENERATE_CONFIG


def test_a_manifest_json_that_is_not_a_json_object_is_not_ours(tmp_path):
    (tmp_path / "manifest.json").write_text("name: someone else's yaml\n")
    out = Output(str(tmp_path))
    assert out.manifest.foreign and not out.manifest.damaged
    assert out.foreign_files() == ["manifest.json"]


def test_shards_of_several_outs_refuse_a_rebuild_naming_them(tmp_path):
    make_out(tmp_path / "out")
    other = make_out(tmp_path / "other")
    shutil.copy(shard_files(other.fs, other.folder("data"))[0], tmp_path / "out" / "data")
    (tmp_path / "out" / "manifest.json").unlink()
    with pytest.raises(OutputMismatch, match=f"shards of several OUTs: .*out_id {other.manifest.out_id}: .*--fresh"):
        rebuild_manifest(Output(str(tmp_path / "out")))


def test_fresh_deletes_every_file_the_project_writes_but_the_lock(tmp_path):
    out = make_out(tmp_path / "out")
    root = tmp_path / "out"
    owned = [".lock", "report.json", "report.html", "report/lengths.png", "vocab/d2t.npy", "vocab/vocab.json",
             ".staging/x.parquet", "quarantine/data/part-20260101T000000-aaaaaa-00000.parquet",
             "quarantine/manifest-20260101T000000-aaaaaa.json", "hidden_states/part-20260101T000000-aaaaaa-00000.safetensors",
             *(f"{d}/part-20260101T000000-aaaaaa-00000.parquet" for d in ("skipped", "failed", "stopped", "hidden_failed"))]
    for name in owned:
        assert is_ours(name), name
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    old_id = out.manifest.out_id
    out.check_ours()
    out.wipe()
    assert [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()] == [".lock"]
    assert out.manifest.out_id != old_id  # a new OUT: shards of the old one would be foreign


def test_every_tool_calls_a_cut_manifest_damaged_and_names_the_recovery(tmp_path, capsys):
    from eagle_data.__main__ import main
    from support import synthetic_row, write_out

    out = write_out(tmp_path / "out", [synthetic_row(0, 2, 1, 1, "stop", "s")], rows_per_shard=1)
    manifest = out / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    for argv in (["verify"], ["report"], ["inspect"], ["vocab"], ["export", "--format", "jsonl", str(tmp_path / "x.jsonl")]):
        assert main([argv[0], str(out), *argv[1:]]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"error: {manifest} is damaged (JSONDecodeError") and "keeps the data" in err, (argv, err)
    assert len(manifest.read_bytes()) == 40 and not (out / "report.json").exists()


def test_fresh_deletes_an_out_of_an_older_manifest_version_that_a_resume_refuses(tmp_path):
    root = tmp_path / "out"
    make_out(root)
    manifest = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 3}))
    with pytest.raises(EagleDataError, match="older eagle-data.*make it again \\(--fresh\\)"):
        Output(str(root))
    out = Output(str(root), fresh=True)  # what --fresh opens
    out.check_ours()
    out.wipe()
    assert not [p for p in root.rglob("*") if p.is_file()]
