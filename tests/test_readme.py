"""README.md's commands, run as written: only addresses, paths and sizes are substituted
(an OUT made by the tests for `out/demo`, a tiny model for the demo's converted SmolLM2,
fewer samples and tokens). When one of them stops working, a test here fails.
The `ray job submit` line runs in tests/cluster/test_cluster.py, on a real head."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import readme
from support import (REPO, STATES_TOLERANCE, build_babbling_model, hidden_features, job_config, read,
                     states_gap)
from eagle_data.storage.folder import Output

WORDS = [" the", " cat", " sat", " on", " mat", "."]

TOOLS = {"verify", "report", "inspect", "export", "vocab"}


def user_env() -> dict:
    """A user's shell in the checkout: no PYTHONPATH, no cluster address, Ray's own worker
    niceness (conftest.py sets the tests' to 0)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "RAY_worker_niceness")}


def run_as_written(argv: list[str], timeout: float = 600, ray_address: str | None = None) -> subprocess.CompletedProcess:
    """In the checkout, as a user types it; stdout and stderr in one stream, in order.
    `ray_address`: as a user with a running Ray instance (RAY_ADDRESS) types it."""
    assert argv[0] == "python"
    env = {**user_env(), **({"RAY_ADDRESS": ray_address} if ray_address else {})}
    return subprocess.run([sys.executable, *argv[1:]], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def with_out(argv: list[str], out: Path) -> list[str]:
    """`out/demo...` paths (alone or as `output.path=out/demo...`) moved to `out`'s folder."""
    return [re.sub(r"(^|=)out/demo", lambda m: m.group(1) + str(out), a) for a in argv]


@pytest.fixture(scope="module")
def demo_like_out(ray_local, tmp_path_factory, qwen3_tokenizer_dir) -> Path:
    """An OUT like the demo's: answers that end (finish_reason stop) as well as cut-off ones,
    which the README's export and reader snippet filter on."""
    from eagle_data.job.phases.run import run

    tmp = tmp_path_factory.mktemp("readme")
    probs = {**{w: 0.13 for w in WORDS}, "<|im_end|>": 0.2}
    model = build_babbling_model(qwen3_tokenizer_dir, tmp / "babble", ["<|im_end|>", "<|endoftext|>"], probs)
    out = tmp / "demo"
    run(job_config(out, model, source__sample=12, sampling__temperature=1.0, sampling__max_tokens=16,
                   engine__batch_size=4, output__rows_per_shard=4))
    return out


def test_the_readme_shows_every_kind_of_command():
    submit = readme.submit_line()
    assert submit[submit.index("--") + 1:][:3] == ["python", "-m", "ray_jobs.generate"]
    assert readme.starting("python", "-m", "ray_jobs.generate"), "no job command in README.md"
    shown = {argv[3] for argv in readme.starting("python", "-m", "eagle_data")}
    assert shown == TOOLS
    assert any("from eagle_data.reader import" in b for b in readme.blocks("python"))
    assert readme.set_examples()


def test_every_set_example_is_accepted_by_the_config():
    from eagle_data.config import load_config

    for example in readme.set_examples():
        load_config(str(REPO / "configs/demo.yaml"), [example])  # raises, naming the key, when not


@pytest.mark.slow
def test_the_tool_commands_run_as_written(demo_like_out, tmp_path):
    out = tmp_path / "demo"
    shutil.copytree(demo_like_out, out)  # report and vocab write into OUT
    for argv in readme.starting("python", "-m", "eagle_data"):
        argv = with_out(argv, out)
        done = run_as_written(argv)
        assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout[-3000:]}"
        assert "Traceback" not in done.stdout, done.stdout[-3000:]
    assert (tmp_path / "demo-specforge.jsonl").stat().st_size > 0
    assert (out / "vocab" / "vocab_mapping.pt").is_file() and (out / "vocab" / "d2t-32000.npy").is_file()
    assert (out / "report.html").is_file()


@pytest.mark.slow
def test_the_reader_snippet_runs_as_written(demo_like_out):
    [snippet] = [b for b in readme.blocks("python") if "from eagle_data.reader import" in b]
    assert '"out/demo"' in snippet
    namespace = {"rank": 0, "world": 1}  # what a trainer's launcher gives it
    exec(compile(snippet.replace('"out/demo"', repr(str(demo_like_out))), "README.md", "exec"), namespace)
    batch = next(iter(namespace["loader"]))
    assert {"input_ids", "loss_mask", "attention_mask"} <= set(batch)
    assert batch["input_ids"].shape == batch["loss_mask"].shape == batch["attention_mask"].shape
    assert int(batch["loss_mask"].sum()) > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_the_job_commands_run_as_written_and_read_clean(ray_local, tmp_path, qwen3_tokenizer_dir):
    """Each job command of the README on the demo config, on vLLM, in the order shown,
    with the demo's model swapped for a tiny one and fewer samples and tokens: it exits 0,
    prints no traceback, says what the engine does while it starts, and its summary is the
    last thing it prints. The first runs exactly as a user types it (it starts its own Ray
    instance); the others join the session's (RAY_ADDRESS, as on a machine with Ray
    running), a Ray start saved per command. The hidden-states command's features (vLLM,
    the demo's bfloat16, tensor parallel 1) equal the transformers pass's float32 states on
    the same rows within bfloat16's tolerance (tests/vllm/test_hidden_states_vllm.py checks
    float32 at tensor parallel 2)."""
    from support import build_tiny_model

    model = build_tiny_model(qwen3_tokenizer_dir, tmp_path / "tiny-qwen3-h64", head_dim=64)
    out = tmp_path / "demo"
    # One engine thread: the demo's all cores serve its real model; a tiny one gains nothing from them.
    sizes = ["--set", "source.sample=6", "--set", "sampling.max_tokens=16", "--set", "output.log_every_s=2",
             "--set", "engine.cpu_threads=1"]
    commands = [c for c in readme.starting("python", "-m", "ray_jobs.generate") if not dataset_answers(c)]
    assert any("--phase" not in c for c in commands), "no command that runs the engine"
    assert any("hidden_states" in c for c in commands), "no hidden-states command"
    address = ray_local.get_runtime_context().gcs_address
    for i, argv in enumerate(commands):
        argv = with_out(argv, out)
        if not any(a.startswith("output.path=") for a in argv):
            argv += ["--set", f"output.path={out}"]
        argv += ["--set", f"model.path={model}", *sizes]
        done = run_as_written(argv, ray_address=address if i else None)
        log = done.stdout
        assert done.returncode == 0, f"{' '.join(argv)}:\n{log[-4000:]}"
        assert "Traceback" not in log, log[-6000:]
        lines = log.rstrip().splitlines()
        summary = max(i for i, line in enumerate(lines) if line.startswith("OUT = "))
        assert all(line.startswith("  ") for line in lines[summary + 1:]), lines[summary:]
        assert lines[-1].startswith("  manifest: "), log[-2000:]
        if i == 0:  # its own Ray, whose workers are at Ray's niceness, 15: the driver steps down to it
            own = os.getpriority(os.PRIO_PROCESS, 0)
            assert (f"driver: niceness {own} -> 15" in log) == (own < 15), log[-3000:]
        if "hidden_states" in argv:  # on the OUT the command before it made
            assert "hidden_states/ 6 of 6 selected samples; 0 failed attempts" in log, log[-3000:]
        if "--phase" not in argv:
            assert "data/     6 ok samples" in log
            assert "replica(s) loading the model" in log and "rows in the engine" in log, log[-3000:]
            assert "logging_progress" not in log, "Ray Data's per-operator progress dump is on"
    check_states_against_transformers(out, model)


def dataset_answers(argv: list[str]) -> bool:
    return "prompt.answers=dataset" in argv


@pytest.mark.slow
def test_the_dataset_answers_command_runs_as_written(ray_local, tmp_path, tiny_qwen3):
    """The README's command for an OUT of the dataset's own answers, in the checkout as a
    user types it (joining the session's Ray, as a user with Ray running), the demo's
    converted SmolLM2 swapped for the tiny Qwen3 and its OUT moved, as for every job command
    here. `make demo-dataset` runs the same command. It starts no engine, and makes an OUT
    that verify passes, every data/ row answered by the dataset."""
    from eagle_data.tools.verify import verify

    [argv] = [c for c in readme.starting("python", "-m", "ray_jobs.generate") if dataset_answers(c)]
    assert "$(PY) " + " ".join(argv[1:]) in (REPO / "Makefile").read_text(), "make demo-dataset runs another command"
    argv = with_out(argv, tmp_path / "demo") + ["--set", f"model.path={tiny_qwen3}"]
    assert f"output.path={tmp_path}/demo-dataset" in argv
    done = run_as_written(argv, ray_address=ray_local.get_runtime_context().gcs_address)
    log = done.stdout
    assert done.returncode == 0, f"{' '.join(argv)}:\n{log[-4000:]}"
    assert "Traceback" not in log and "loading the model" not in log, log[-4000:]
    assert "engine: none; the answers are the dataset's own" in log and "(the dataset's own answers)" in log
    out = tmp_path / "demo-dataset"
    problems, counts = verify(str(out))
    rows = read(out, "data")
    assert problems == [] and counts["ok"] == len(rows) > 0, problems
    assert {r["answered_by"] for r in rows} == {"dataset"}


def check_states_against_transformers(out: Path, model: Path) -> None:
    from eagle_data.job.stages.engines.transformers_hidden_states import TransformersHiddenStates
    from eagle_data.storage.hidden_states import Index

    stored = hidden_features(out)
    meta = Index.read(Output(str(out)).fs, str(out / "hidden_states"))
    assert meta.dtype == "bfloat16" and len(stored) == 6, (meta.dtype, len(stored))
    reference = TransformersHiddenStates(str(model), False, meta.layer_ids, "float32")
    want = {r["sample_id"]: reference.states(list(r["input_ids"])) for r in read(out, "data")}
    max_rel, min_cos = states_gap(stored, want)
    rel_tol, cos_tol = STATES_TOLERANCE["bfloat16"]
    print(f"\nthe README's hidden-states command (vLLM, bfloat16, layer ids {meta.layer_ids}): largest relative "
          f"difference {max_rel:.3g}, smallest cosine {min_cos:.7f} against transformers' float32 states")
    assert max_rel <= rel_tol and min_cos >= cos_tol, (max_rel, min_cos)
