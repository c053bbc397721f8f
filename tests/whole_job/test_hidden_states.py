"""The hidden-states phase on the transformers engine, on a real local Ray, with an 8-layer
tiny Qwen3 and real data/ rows: what it publishes, that it equals the model's own states,
resume after a SIGKILL, the per-row checks, the storage estimate and the config checks.
(vLLM's engine for this phase: tests/vllm/test_hidden_states_vllm.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pytest
import torch
import yaml

from support import REPO, attached, data_rows, job_config, job_settings, read
from eagle_data.errors import ConfigError, EagleDataError, EmptyResult, NotEnoughSpace, OutputMismatch
from eagle_data.feature_shape import eagle3_layer_ids
from eagle_data.job.phases.run import run
from eagle_data.job.stages.engines.state_files import as_columns, with_state_columns
from eagle_data.job.stages.pack_hidden_states import check_states
from eagle_data.storage.folder import Output
from eagle_data.storage.damage import quarantine_corrupt
from eagle_data.storage.hidden_states import Index, read_header, read_sample, shard_paths
from eagle_data.tools.verify import verify

HIDDEN = dict(engine__batch_size=4, sampling__max_tokens=12, source__sample=12, output__rows_per_shard=4,
              hidden_states__dtype="float32")


def hidden_index(out) -> Index:
    o = Output.existing(str(out))
    return Index.read(o.fs, o.folder("hidden_states"))


def without_hidden_states(src, dest):
    """A copy of an OUT as it was before its hidden-states phase (data/ complete)."""
    shutil.copytree(src, dest)
    for folder in ("hidden_states", "hidden_failed"):
        shutil.rmtree(dest / folder, ignore_errors=True)
    manifest = json.loads((dest / "manifest.json").read_text())
    del manifest["phases"]["hidden_states"]
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def reference(model_dir, input_ids: list[int]):
    """HF's hidden_states (embeddings, then after each layer; the last one after the final norm)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
    return model, [h[0] for h in out.hidden_states]


@pytest.mark.slow  # reads hidden_out, made by the whole job
def test_every_row_gets_the_models_own_states_once(hidden_out, deep_qwen3):
    index = hidden_index(hidden_out)
    rows = data_rows(hidden_out)
    assert set(index.entries) == set(rows) and not index.duplicates
    assert index.layer_ids == [2, 4, 5, 8] == eagle3_layer_ids(8)
    features = Output.existing(str(hidden_out)).manifest.phase("hidden_states")["features"]
    assert features == {"layer_ids": [2, 4, 5, 8], "final_norm": "pre", "dtype": "float32", "hidden_size": 64,
                        "num_layers": 8}
    sample_id = sorted(rows)[0]
    ids = rows[sample_id]["input_ids"]
    stored = read_sample(Output.existing(str(hidden_out)).fs, index.entries[sample_id], "float32")
    assert stored.shape == (len(ids), 4, 64)
    model, hf = reference(deep_qwen3, ids)
    for j, k in enumerate([2, 4, 5]):
        torch.testing.assert_close(stored[:, j], hf[k], rtol=1e-5, atol=1e-5)
    # Id L is before the final norm: the model's norm of it is HF's last hidden state.
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(stored[:, 3]), hf[8], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(stored[:, 3], hf[8])
    problems, counts = verify(str(hidden_out))
    assert problems == [] and counts["hidden_states"] == len(rows) and counts["hidden_states_finished"]
    report = json.loads((hidden_out / "report.json").read_text())["hidden_states"]
    assert report["samples"] == len(rows) and report["bytes"] == report["tokens"] * 4 * 64 * 4
    assert report["runs"][-1]["estimate_bytes"] == report["bytes"]


@pytest.mark.slow  # reads hidden_out, made by the whole job
def test_verify_finds_a_flipped_byte_and_a_cut_shard(hidden_out, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(hidden_out, out)
    shard = shard_paths(Output.existing(str(out)).fs, str(out / "hidden_states"))[0]
    with open(shard, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems, _ = verify(str(out))
    assert any("crc32" in p for p in problems), problems
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 10)
    assert any("bytes, its header lists" in p for p in verify(str(out))[0])
    # A run's start moves a cut shard aside, so its samples are simply not done.
    lost = set(read_header(Output(str(out)).fs, shard)[1])
    assert quarantine_corrupt(Output(str(out))) == [shard]
    assert (out / "quarantine" / "hidden_states" / os.path.basename(shard)).is_file()
    assert lost and not lost & set(hidden_index(out).entries)


def with_header(src, dest, **changes):
    """A copy of hidden-states shard `src` whose header metadata has `changes` (None: the key
    removed): another OUT's shard, or one an older eagle-data wrote. Offsets are relative to
    the header's end, so the tensors' bytes follow unchanged."""
    import struct

    raw = open(src, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    for key, value in changes.items():
        header["__metadata__"].pop(key) if value is None else header["__metadata__"].update({key: value})
    text = json.dumps(header).encode()
    with open(dest, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + raw[8 + n:])


@pytest.mark.slow  # reads hidden_out, made by the whole job
def test_a_hidden_states_shard_of_another_out_or_config_is_named_and_quarantined(hidden_out, tmp_path):
    """Every hidden-states shard's header names its OUT, run and config fingerprint, like a
    Parquet shard's footer; one copied in from another OUT, made under another
    hidden_states config, or without them is named by verify and moved aside at start."""
    from eagle_data.storage.contract import FINGERPRINT_KEY, OUT_ID_KEY, RUN_KEY
    from eagle_data.storage.manifest import fingerprint

    out = tmp_path / "out"
    shutil.copytree(hidden_out, out)
    o = Output.existing(str(out))
    expected = fingerprint(o.manifest.phase_config("hidden_states"))
    shards = shard_paths(o.fs, str(out / "hidden_states"))
    for shard in shards:
        meta, _ = read_header(o.fs, shard)
        assert meta[OUT_ID_KEY] == o.manifest.out_id and meta[FINGERPRINT_KEY] == expected
        assert meta[RUN_KEY] == meta["run_id"] and os.path.basename(shard).startswith(f"part-{meta['run_id']}-")
    assert verify(str(out))[0] == []
    src = shards[0]
    lost = read_header(o.fs, src)[1]
    os.remove(src)  # its samples come back, three times over, from shards that are not this OUT's
    made = {name: str(out / "hidden_states" / f"part-20260101T000000-{name}-00000.safetensors")
            for name in ("aaaaaa", "bbbbbb", "cccccc")}
    with_header(os.path.join(hidden_out, "hidden_states", os.path.basename(src)), made["aaaaaa"], **{OUT_ID_KEY: "0" * 32})
    with_header(os.path.join(hidden_out, "hidden_states", os.path.basename(src)), made["bbbbbb"], **{FINGERPRINT_KEY: "f" * 16})
    with_header(os.path.join(hidden_out, "hidden_states", os.path.basename(src)), made["cccccc"], **{OUT_ID_KEY: None})
    problems = [p for p in verify(str(out))[0] if "not this OUT's shard" in p]
    assert [p.split(":")[0] for p in problems] == sorted(made.values()), problems
    assert "another OUT" in problems[0] and "another hidden_states config" in problems[1] and "names no OUT" in problems[2]
    assert sorted(quarantine_corrupt(Output(str(out)))) == sorted(made.values())
    # Its samples are now simply not done: verify says so (the next run of the phase redoes them).
    [missing] = verify(str(out))[0]
    assert missing.startswith(f"{len(lost)} selected data/ rows have neither hidden states"), missing


@pytest.mark.slow
def test_sigkill_mid_phase_then_rerun_gives_every_row_once(ray_local, hidden_out, deep_qwen3, tmp_path):
    out = without_hidden_states(hidden_out, tmp_path / "out")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_settings(out, deep_qwen3, preset=HIDDEN, engine__batch_size=1,
                                                  hidden_states__rows_per_shard=1)))
    command = [sys.executable, "-m", "ray_jobs.generate", "--config", str(config), "--phase", "hidden_states"]
    job = subprocess.Popen(command, cwd=REPO, env=attached(ray_local), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while len(list((out / "hidden_states").glob("*.safetensors"))) < 2 and job.poll() is None:
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)
    assert job.poll() is None, "the phase finished before it could be killed"
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    published = set(hidden_index(out).entries)
    assert 2 <= len(published) < len(data_rows(out))
    assert verify(str(out))[0] == []  # what the killed run published is valid
    rerun = subprocess.run(command, cwd=REPO, env=attached(ray_local), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    index = hidden_index(out)
    assert set(index.entries) == set(data_rows(out)) and not index.duplicates
    assert published <= set(index.entries)
    assert not list((out / ".staging").rglob("*.safetensors"))
    problems, counts = verify(str(out))
    assert problems == [] and counts["hidden_states_finished"]
    n = len(data_rows(out))
    assert f"hidden_states/ {n} of {n} selected samples; 0 failed attempts" in rerun.stdout, rerun.stdout


def corrupting_engine(bad: dict[str, str]):
    """A test double of the engine (the logic around it is what is tested): hands each row's
    states on the way the engines do, with true-looking values, and breaks the rows in `bad`
    (sample_id -> how)."""
    def engine(ds, cfg, layer_ids, dtype, scratch):
        def answer(batch: pa.Table) -> pa.Table:
            states = []
            for row in batch.select(["sample_id", "input_ids"]).to_pylist():
                ids = row["input_ids"]
                hidden = torch.randn(len(ids), len(layer_ids), 64)
                how = bad.get(row["sample_id"])
                if how == "zeros":
                    hidden[:, 1] = 0
                elif how == "nan":
                    hidden[3, 0, 5] = float("nan")
                elif how == "short":  # vLLM #44485: fewer rows than tokens
                    hidden, ids = hidden[:-2], ids[:-2]
                states.append(as_columns(hidden, ids))
            batch = batch.append_column("__inference_error__", pa.array([""] * batch.num_rows))
            handed = pa.Table.from_pylist(states)
            for name in handed.column_names:
                batch = batch.append_column(name, handed.column(name))
            return with_state_columns(batch)
        return ds.map_batches(answer, batch_format="pyarrow")
    return engine


@pytest.mark.slow  # reads hidden_out, made by the whole job
def test_rows_that_fail_a_check_are_recorded_and_never_published(ray_local, hidden_out, deep_qwen3, tmp_path):
    from eagle_data.job.phases.hidden_states import run_hidden_states

    out = without_hidden_states(hidden_out, tmp_path / "out")
    ids = sorted(data_rows(out))
    bad = {ids[0]: "zeros", ids[1]: "nan", ids[2]: "short"}
    cfg = job_config(out, deep_qwen3, preset=HIDDEN, output__max_attempts=2)
    for attempt in (1, 2):
        counts = run_hidden_states(cfg, Output(str(out)), engine=corrupting_engine(bad))
    n = len(ids)
    assert counts == {"selected": n, "ok": n - 3, "failed_final": 3, "pending_retry": 0, "failed_rows": 6}
    assert set(hidden_index(out).entries) == set(ids) - set(bad)
    errors = {r["sample_id"]: r["error"] for r in read(out, "hidden_failed")}
    assert "layer id(s) [4] are all zeros" in errors[ids[0]]
    assert "non-finite" in errors[ids[1]]
    assert "shape" in errors[ids[2]] and "expected" in errors[ids[2]]
    # Given up after max_attempts: a third run asks nothing more.
    assert run_hidden_states(cfg, Output(str(out)), engine=corrupting_engine(bad))["failed_rows"] == 6
    assert verify(str(out))[0] == []


def test_check_states_on_real_tensors():
    ids = [5, 6, 7, 8]
    good = torch.randn(4, 3, 16)
    assert check_states(good, torch.tensor(ids), ids, [2, 4, 8], 16) == ""
    assert "token_ids differ" in check_states(good, torch.tensor([5, 6, 7, 9]), ids, [2, 4, 8], 16)
    assert "shape" in check_states(good[:, :2], torch.tensor(ids), ids, [2, 4, 8], 16)
    inf = good.clone()
    inf[0, 0, 0] = float("inf")
    assert "non-finite" in check_states(inf, torch.tensor(ids), ids, [2, 4, 8], 16)


def test_eagle3_layer_ids_are_the_peers_choice():
    assert eagle3_layer_ids(61) == [2, 30, 58, 61]  # Kimi-K2.5 (Model-Optimizer's launcher)
    assert eagle3_layer_ids(36) == [2, 18, 33, 36]  # speculators' [2, L//2, L-3, L]
    assert eagle3_layer_ids(2) == [1, 2]  # too shallow for four: the distinct ones


@pytest.mark.slow  # reads hidden_out, made by the whole job
def test_refused_before_it_starts(ray_local, hidden_out, deep_qwen3, tmp_path, monkeypatch):
    out = without_hidden_states(hidden_out, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"layer_ids \[9\] exceed the target's 8 layers"):
        run(job_config(out, deep_qwen3, preset=HIDDEN, hidden_states__layer_ids=[2, 9]), phase="hidden_states")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(NotEnoughSpace, match=r"needs about \d+\.\d\d KiB .* has 1000 B free"):
        run(job_config(out, deep_qwen3, preset=HIDDEN), phase="hidden_states")
    assert "hidden_states" not in json.loads((out / "manifest.json").read_text())["phases"]
    monkeypatch.undo()
    with pytest.raises(OutputMismatch, match="hidden_states.dtype"):
        run(job_config(hidden_out, deep_qwen3, preset=HIDDEN, hidden_states__dtype="bfloat16"), phase="hidden_states")


def listing(out, *folders) -> dict[str, list[str]]:
    return {f: sorted(p.name for p in (out / f).glob("*")) for f in folders}


@pytest.mark.slow  # reads hidden_out, made by the whole job
def test_fresh_with_a_phase_resets_that_phase_only(ray_local, hidden_out, deep_qwen3, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(hidden_out, out)
    earlier = ("prompts", "skipped", "data", "failed", "stopped")
    kept, records = listing(out, *earlier), json.loads((out / "manifest.json").read_text())["phases"]
    # Another dtype would be refused on these hidden states; --fresh deletes them, not data/.
    counts = run(job_config(out, deep_qwen3, preset=HIDDEN, hidden_states__dtype="bfloat16"),
                 phase="hidden_states", fresh=True)
    assert counts["hidden_states"]["ok"] == counts["hidden_states"]["selected"] == len(data_rows(out)) > 0
    assert listing(out, *earlier) == kept
    manifest = json.loads((out / "manifest.json").read_text())
    assert [manifest["phases"][p] for p in ("prompts", "generate")] == [records["prompts"], records["generate"]]
    assert manifest["phases"]["hidden_states"]["features"]["dtype"] == "bfloat16"
    assert len(manifest["phases"]["hidden_states"]["runs"]) == 1  # the old runs went with their rows


@pytest.mark.slow  # reads hidden_out, made by the whole job
def test_a_hidden_states_filter_selecting_nothing_exits_3_and_a_corrected_one_runs(ray_local, hidden_out, deep_qwen3,
                                                                                  tmp_path):
    out = without_hidden_states(hidden_out, tmp_path / "out")
    with pytest.raises(EmptyResult, match=r"0 rows selected .*hidden_states\.source.*--allow-empty") as e:
        run(job_config(out, deep_qwen3, preset=HIDDEN, hidden_states__source=["nope"]), phase="hidden_states")
    assert e.value.exit_code == 3
    # It published no rows: its config binds nothing, and the corrected filter runs.
    counts = run(job_config(out, deep_qwen3, preset=HIDDEN), phase="hidden_states")
    assert counts["hidden_states"]["ok"] == counts["hidden_states"]["selected"] == len(data_rows(out)) > 0


@pytest.mark.slow
def test_hidden_states_of_tokens_answered_again_are_redone(ray_local, deep_qwen3, tmp_path):
    """A cut data/ shard is quarantined and its samples answered again; sampled, they get
    other tokens. Their old hidden states no longer belong to their row: verify names them,
    the reader and export refuse them, and the phase redoes them from the new tokens."""
    from eagle_data.reader import Samples
    from eagle_data.tools.export import export

    out = tmp_path / "out"
    cfg = job_config(out, deep_qwen3, preset=HIDDEN, sampling__temperature=1.0, hidden_states__enabled=True)
    run(cfg)
    before = data_rows(out)
    shard = sorted((out / "data").glob("*.parquet"))[0]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    # The transformers engine seeds each batch: one row per batch samples other tokens.
    cfg = job_config(out, deep_qwen3, preset=HIDDEN, sampling__temperature=1.0, hidden_states__enabled=True,
                     engine__batch_size=1)
    run(cfg, phase="generate")
    after = data_rows(out)
    changed = sorted(s for s in after if after[s]["input_ids"] != before[s]["input_ids"])
    assert changed, "sampled again, the answers should differ"
    report = json.loads((out / "report.json").read_text())["hidden_states"]
    assert report["samples"] == len(after) - len(changed), report  # stale entries are not counted
    problems = verify(str(out))[0]
    assert [p for p in problems if "other tokens" in p and changed[0] in p], problems
    with pytest.raises(EagleDataError, match="other tokens"):
        list(Samples(str(out), shuffle=False, hidden_states=True))
    with pytest.raises(EagleDataError, match="other tokens"):
        export(str(out), str(tmp_path / "dest"), "speculators-offline")
    run(cfg, phase="hidden_states")
    index = hidden_index(out)
    assert set(index.entries) == set(after) and not index.duplicates
    fs = Output.existing(str(out)).fs
    for sample_id in changed:
        _, hf = reference(deep_qwen3, after[sample_id]["input_ids"])
        torch.testing.assert_close(read_sample(fs, index.entries[sample_id], "float32")[:, 0], hf[2],
                                   rtol=1e-5, atol=1e-5)
    assert verify(str(out))[0] == []


@pytest.mark.slow  # reads hidden_out, made by the whole job
def test_a_damaged_tensor_is_never_served_and_a_rerun_redoes_it(ray_local, hidden_out, deep_qwen3, tmp_path):
    """A byte flipped inside a tensor: the reader and export check its crc32 as verify does
    and refuse it, naming the sample; the next run of the phase quarantines its shard and
    redoes that shard's samples."""
    from eagle_data.reader import Samples
    from eagle_data.tools.export import export

    out = tmp_path / "out"
    shutil.copytree(hidden_out, out)
    fs = Output.existing(str(out)).fs
    shard = shard_paths(fs, str(out / "hidden_states"))[0]
    lost = read_header(fs, shard)[1]
    damaged = max(lost, key=lambda s: lost[s].end)  # the last tensor: the byte flipped lies in it
    with open(shard, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(EagleDataError, match=f"{damaged}.*crc32"):
        list(Samples(str(out), shuffle=False, hidden_states=True))
    with pytest.raises(EagleDataError, match=f"{damaged}.*crc32"):
        export(str(out), str(tmp_path / "dest"), "speculators-offline")
    assert not (tmp_path / "dest").exists()
    run(job_config(out, deep_qwen3, preset=HIDDEN, hidden_states__rows_per_shard=3), phase="hidden_states")
    assert (out / "quarantine" / "hidden_states" / os.path.basename(shard)).is_file()
    index = hidden_index(out)
    assert set(lost) <= set(index.entries) and set(index.entries) == set(data_rows(out)) and not index.duplicates
    assert verify(str(out))[0] == []
