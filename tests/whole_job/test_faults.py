"""Never lose work: kills of the driver and of engine actors, rows the engine fails on,
damaged shards, and bad setup, on a real local Ray with the tiny Qwen3 model."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from support import REPO, as_config, attached, job_settings, read, ray_processes, shards
from eagle_data.errors import OutputLocked, OutputMismatch
from eagle_data.storage.folder import Output
from eagle_data.job.phases.run import run
from eagle_data.tools.inspect_out import inspect
from eagle_data.tools.verify import verify


# Two rows per engine batch and shard, two attempts per sample.
FAULTS = dict(engine__batch_size=2, output__rows_per_shard=2, output__max_attempts=2)








def assert_verified(out):
    problems, counts = verify(str(out))
    assert problems == [], problems
    return counts


# Three sampling variants (greedy; hot with top-k; thinking off on Qwen3's switch) and two
# answers per prompt.
VARIANTS = dict(sampling__answers_per_prompt=2, sampling__seed=5, sampling__variants=[
    {"name": "greedy", "weight": 2},
    {"name": "hot", "temperature": 1.0, "top_k": 20, "top_p": 0.9},
    {"name": "no_think", "temperature": 0.6, "min_p": 0.05, "chat_template_kwargs": {"enable_thinking": False}}])


@pytest.mark.slow
def test_driver_sigkill_in_each_phase_then_resume(ray_local, tmp_path, tiny_qwen3):
    """SIGKILL the job's driver from outside in the prompts phase, then mid-generate, rerun
    the same command each time; in the end every sample is in data/ exactly once and the counts add up.
    With three variants and two answers per prompt: no conversation is ever reassigned a
    variant or a seed, and each row records the values it was answered with."""
    from eagle_data.job.stages.requests import row_seed
    from eagle_data.job.variants import Assigner, variants
    from eagle_data.model_files import load_tokenizer

    config = tmp_path / "job.yaml"
    # One row per engine batch and shard, so that kills land between shards.
    settings = job_settings(tmp_path / "out", tiny_qwen3, preset=FAULTS, engine__batch_size=1,
                            sampling__max_tokens=32, source__sample=12, **VARIANTS)
    config.write_text(yaml.safe_dump(settings))
    cfg = as_config(settings)
    out = tmp_path / "out"
    env = attached(ray_local)
    command = [sys.executable, "-m", "ray_jobs.generate", "--config", str(config)]

    def start():
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    # First a kill as soon as the prompts phase has published anything (usually mid-phase).
    job = start()
    while not shards(out, "prompts") and job.poll() is None:
        time.sleep(0.01)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()

    # Then a kill once 4 data shards (4 rows) are published, mid-generate.
    job = start()
    deadline = time.monotonic() + 240
    while len(shards(out, "data")) < 4 and job.poll() is None:
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)
    assert job.poll() is None, "the job finished before it could be killed"
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    rows = read(out, "data")
    killed_at = len(rows)
    answered_as = {r["sample_id"]: (r["variant"], r["sampling"]) for r in rows}
    # What a killed run published stays valid data.
    assert not verify(str(out))[0]

    assert subprocess.run(command, cwd=REPO, env=env, capture_output=True).returncode == 0
    counts = assert_verified(out)
    manifest = json.loads((out / "manifest.json").read_text())
    prompts = manifest["phases"]["prompts"]["counts"]
    assert counts["ok"] == prompts["conversations"] == 2 * prompts["prompts"] and counts["failed"] == 0
    assert prompts["prompts"] + counts["skipped"] == prompts["selected"]
    runs = manifest["phases"]["generate"]["runs"]
    # Each rerun only did what earlier runs had not published.
    assert [r["todo"] for r in runs][1:] == [prompts["conversations"] - killed_at]
    assert runs[-1]["status"] == "complete" and runs[-1]["ok"] == prompts["conversations"] - killed_at

    # A row published before the kill stays as it was. Every conversation: the variant its id
    # and the seed draw, the prompt its variant renders, and the exact values it was answered with.
    found, draw, tokenizer = variants(cfg), Assigner(variants(cfg), 5), load_tokenizer(str(tiny_qwen3))
    by_id = {p["sample_id"]: p for p in read(out, "prompts")}
    data = read(out, "data")
    for r in data:
        prompt, variant = by_id[r["sample_id"]], found[r["variant"]]
        assert r["variant"] == prompt["variant"] == draw(r["sample_id"])
        assert r["sample_id"] == f"{r['prompt_id']}.{r['answer']}" and r["answer"] in (0, 1)
        assert r["sampling"] == {**variant.sampling, "seed": row_seed(5, r["sample_id"])}
        assert answered_as.get(r["sample_id"], (r["variant"], r["sampling"])) == (r["variant"], r["sampling"])
        expected = tokenizer.apply_chat_template([{k: v for k, v in m.items() if v is not None} for m in r["messages"]],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False,
                                                 **variant.chat_template_kwargs)
        assert r["input_ids"][:r["num_prompt_tokens"]] == list(prompt["tokenized_prompt"]) == expected
    assert {r["variant"] for r in data} == set(found)
    greedy = [r for r in data if r["variant"] == "greedy"]  # greedy: both answers of a prompt are the same
    assert all(a["input_ids"] == b["input_ids"] for a in greedy for b in greedy if a["prompt_id"] == b["prompt_id"])
    report = json.loads((out / "report.json").read_text())["by_variant"]
    assert {name: (v["conversations"], v["ok"]) for name, v in report.items()} == {
        name: (n, sum(r["variant"] == name for r in data)) for name, n in prompts["conversations_by_variant"].items()}
    assert sum(v["completion_tokens"]["count"] for v in report.values()) == len(data)
    shown = inspect(str(out))  # the summary's per-variant table: name, conversations, ok
    for name, v in report.items():
        assert re.search(rf"^{name} +{v['conversations']} +{v['ok']} ", shown, re.M), shown
    print(f"\nfault matrix: driver SIGKILL; ok rows on disk after the kill {killed_at}; "
          f"todo per run {[r['todo'] for r in runs]}; final ok {counts['ok']} of {prompts['conversations']} "
          f"conversations ({prompts['prompts']} prompts x 2), skipped {counts['skipped']}, selected "
          f"{prompts['selected']}; by variant {prompts['conversations_by_variant']}")


@pytest.mark.slow
def test_engine_actor_killed_mid_run_loses_nothing(ray_local, tmp_path, tiny_qwen3):
    cfg = as_config(job_settings(tmp_path / "out", tiny_qwen3, preset=FAULTS, source__sample=24))
    out = tmp_path / "out"
    killed = []

    def kill_engine_once_data_flows():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            pids = ray_processes("TransformersEngine")
            if pids and len(shards(out, "data")) >= 2:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.1)

    killer = threading.Thread(target=kill_engine_once_data_flows)
    killer.start()
    result = run(cfg)["generate"]
    killer.join()
    assert killed, "the engine actor was never killed"
    counts = assert_verified(out)
    assert result["ok"] == counts["ok"] == counts["prompts"] and counts["failed"] == 0
    assert len(read(out, "data")) == counts["prompts"]


def _plant_bad_prompts(out, n):
    """Give n prompts a token id outside the vocabulary: the model raises on them, every time."""
    shard = shards(out, "prompts")[0]
    table = pq.read_table(shard)
    rows = table.to_pylist()
    for row in rows[:n]:
        row["tokenized_prompt"] = row["tokenized_prompt"] + [10**7]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), shard)
    return {r["sample_id"] for r in rows[:n]}


@pytest.mark.slow
def test_rows_the_engine_fails_on_are_retried_then_given_up(ray_local, tmp_path, tiny_qwen3):
    cfg = as_config(job_settings(tmp_path / "out", tiny_qwen3, preset=FAULTS, source__sample=16))  # max_attempts: 2
    out = tmp_path / "out"
    run(cfg, phase="prompts")
    bad = _plant_bad_prompts(out, 2)

    first = run(cfg)["generate"]
    assert {f["sample_id"] for f in read(out, "failed")} == bad
    assert first["pending_retry"] == 2 and first["failed_final"] == 0
    assert all(f["error"] == "IndexError: index out of range in self" for f in read(out, "failed"))

    second = run(cfg)["generate"]  # retries exactly the failed rows; they fail again
    assert sorted(f["sample_id"] for f in read(out, "failed")) == sorted(list(bad) * 2)
    assert second["failed_final"] == 2 and second["pending_retry"] == 0

    third = run(cfg)["generate"]  # gave up: reported, not retried
    runs = json.loads((out / "manifest.json").read_text())["phases"]["generate"]["runs"]
    assert [r["todo"] for r in runs] == [first["prompts"], 2, 0]
    assert third["failed_final"] == 2 and len(read(out, "failed")) == 4
    counts = assert_verified(out)
    assert counts["ok"] + counts["failed"] + counts["skipped"] == counts["selected"]
    assert counts["failed_final"] == 2


@pytest.mark.slow
def test_damaged_prompts_shard_makes_the_prompts_phase_run_again(ray_local, tmp_path, tiny_qwen3):
    cfg = as_config(job_settings(tmp_path / "out", tiny_qwen3, preset=FAULTS, source__sample=12, output__rows_per_shard=4))
    out = tmp_path / "out"
    run(cfg, phase="prompts")
    shards(out, "prompts")[0].write_bytes(b"PAR1 not really")
    run(cfg)
    counts = assert_verified(out)
    assert counts["ok"] == counts["prompts"] and counts["prompts"] + counts["skipped"] == 12


def test_verify_catches_a_duplicated_sample(small_out, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(small_out, out)
    assert verify(str(out))[0] == []
    first = shards(out, "data")[0]
    (out / "data" / "part-copy-00000.parquet").write_bytes(first.read_bytes())
    problems, _ = verify(str(out))
    assert any("times in data/ (exactly-once broken)" in p for p in problems)


@pytest.mark.slow
def test_bad_setup_fails_fast_with_a_message(ray_local, tmp_path, tiny_qwen3, caplog):
    base = job_settings(tmp_path / "out", tiny_qwen3, preset=FAULTS, source__sample=4)

    missing = as_config({**base, "model": {"path": str(tmp_path / "no-such-model")}})
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        run(missing)

    (tmp_path / "a-file").write_text("x")
    unwritable = as_config({**base, "output": {"path": str(tmp_path / "a-file" / "out")}})
    with pytest.raises(PermissionError, match="is not writable.*choose another output.path"):
        run(unwritable)

    run(as_config(base))
    changed = as_config({**base, "sampling": {"max_tokens": 16, "temperature": 0.1, "seed": 5}})
    with pytest.raises(OutputMismatch, match=r"changed: sampling\.seed, sampling\.temperature\).*--fresh"):
        run(changed, phase="generate")

    # A live run holds the lock: a second one on the same OUT is refused.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "out" / ".lock").write_text(json.dumps(
            {"pid": holder.pid, "host": __import__("socket").gethostname(), "started": "now"}))
        with pytest.raises(OutputLocked, match=f"pid {holder.pid}"):
            run(as_config(base))
    finally:
        holder.kill()
        holder.wait()
    # Its process gone, the lock is stale and taken over, with a message saying so.
    with caplog.at_level("WARNING", logger="eagle_data"):
        run(as_config(base))
    assert f"taking over the lock on {tmp_path / 'out'} left by pid {holder.pid}" in caplog.text
    assert not (tmp_path / "out" / ".lock").exists()
    assert Output(str(tmp_path / "out")).manifest.finished("prompts")
