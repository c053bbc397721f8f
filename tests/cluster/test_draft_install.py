"""The draft trainer is installable where it runs: a fresh virtual environment installed the
way cluster.yaml's setup_commands install a node, then the trainer's entry point, every
import of its driver and of its Ray Train workers, and one training step of the workers'
own loop, all run from the copy of the project that `ray job submit --working-dir .` uploads.

What it installs, against cluster.yaml (both commands are read from there and checked):
- `python3 -m pip install -U "$HOME/eagle-data[vllm]"`: the project from a copy of the
  repository, with `torch==2.13.0+cpu` (the `cpu` extra's torch, from the local CPU wheel or
  PyTorch's CPU index, pinned by scripts/constraints-cpu.txt) in place of the `vllm` extra.
  That extra is ray[llm]==2.60.0, whose vLLM is the CUDA build: a multi-GB download of GPU
  wheels that cannot run here. vLLM runs in the engine replicas, not in the trainer; what
  the trainer takes from that extra is torch 2.13.0, which vLLM 0.29.0 pins on the cluster and
  the CPU wheel gives here. Nothing else of the `cpu` extra (accelerate, gguf) is installed:
  the cluster does not have it, so it must not stand in for a package the trainer needs. The
  substitution errs on the strict side: a package the trainer imports that only vLLM's
  requirements bring on the cluster fails here (it belongs in the draft extra).
- `bash "$HOME/eagle-data/scripts/install_draft.sh" python3 vllm`: the same script, with no
  extra for the same reason (and -c scripts/constraints-cpu.txt, so that nothing re-resolves
  torch to the CUDA build).
With --no-compile (pip's byte-compiling of every installed file, most never imported here).

Why not less: a `pip install --dry-run --report` proves that the requirements resolve, not
that what they install imports; a venv with --system-site-packages would see the tests' own
venv, where `make setup` put everything, and could not miss a package. So the check is an
install (about 1.5 GB, torch most of it) and a run of the trainer's code in it. Why not more:
a Ray instance and Ray Train's workers on this install would add a Ray start and a worker
process (the trainer's cluster test runs them, in the tests' venv); here the workers' own loop
(draft_loop.train_loop) runs one step in the venv's python, after importing everything it and
Ray Train's TorchTrainer import, with Ray Train's worker context (rank, dataset shard, checkpoint, report, the stream's gate,
prepare_model, device) stood in for.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support import REPO, job_settings, synthetic_row, write_out
from test_upload import ray_upload

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CONSTRAINTS = REPO / "scripts" / "constraints-cpu.txt"
TORCH_CPU = "torch==2.13.0+cpu"
TORCH_CPU_INDEX = os.environ.get("TORCH_CPU_INDEX", "https://download.pytorch.org/whl/cpu")
# The trainer's code: every import in these files, at the top or inside a function, is one the
# driver (`python -m ray_jobs.train_draft`) or a Ray Train worker makes.
TRAINER_FILES = ["ray_jobs/train_draft.py", "eagle_data/training/draft_config.py",
                 "eagle_data/training/draft_trainer.py", "eagle_data/training/draft_loop.py",
                 "eagle_data/training/checkpoints.py", "eagle_data/reader/batches.py",
                 "eagle_data/training/stream_gate.py"]

# Run by the fresh venv's python in the uploaded copy: argv[1] the train config, argv[2] the
# trainer's files. Prints one JSON line: what failed to import, where modules came from, the
# installed versions, and the step's metrics.
WORKER_CHECK = r"""
import ast, importlib, importlib.metadata, importlib.util, json, os, sys, types

config_path, files = sys.argv[1], sys.argv[2].split(",")
failed = {}
try:
    importlib.import_module("ray_jobs.train_draft")  # the entry point's module itself
except Exception as e:
    failed["import ray_jobs.train_draft"] = f"{type(e).__name__}: {e}"
for path in files:
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            wanted = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            wanted = [(node.module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in wanted:
            statement = f"from {module} import {name}" if name else f"import {module}"
            try:
                found = importlib.import_module(module)
                if name and not hasattr(found, name):
                    importlib.import_module(f"{module}.{name}")
            except Exception as e:
                failed[f"{path}: {statement}"] = f"{type(e).__name__}: {e}"
result = {"failed": failed}
if not failed:
    import numpy as np
    import pyarrow as pa
    import ray.train, ray.train.torch, torch
    from ray.data.block import BlockAccessor
    from eagle_data.config import load_config
    from eagle_data.feature_shape import feature_shape
    from eagle_data.training.draft_config import speculators_config
    from eagle_data.training.draft_loop import train_loop
    from eagle_data.model_files import check_weights
    from eagle_data.training.draft_trainer import Plan, draft_vocabulary, loop_config, prepare_save_path

    # The driver's steps before Ray Train starts (draft_trainer.train), then the workers' config.
    cfg = load_config(config_path, [])
    shape = feature_shape(cfg)
    spec = speculators_config(cfg, shape)  # speculators' TrainConfig
    prepare_save_path(spec.trainer.save_path)
    check_weights(cfg.model.path)
    d2t, t2d, vocab_size = draft_vocabulary(cfg, spec, shape)  # speculators' vocab mapping of OUT's counts
    config = loop_config(cfg, spec, d2t, t2d, Plan.of(cfg, spec, shape))
    layers, hidden = len(shape.layer_ids), config["hidden_size"]
    rng = np.random.default_rng(0)
    rows = [{"sample_id": f"s{i}", "epoch": 0, "position": i, "input_ids": rng.integers(0, vocab_size, n).tolist(),
             "loss_mask": [0] * 3 + [1] * (n - 3),
             "hidden_states": rng.standard_normal((n, layers, hidden), dtype=np.float32).tobytes(),
             "hidden_states_shape": [n, layers, hidden]} for i, n in enumerate([9, 7])]
    schema = pa.schema([("sample_id", pa.string()), ("epoch", pa.int64()), ("position", pa.int64()), ("input_ids", pa.list_(pa.int64())),
                        ("loss_mask", pa.list_(pa.int64())), ("hidden_states", pa.large_binary()),
                        ("hidden_states_shape", pa.list_(pa.int64()))])
    batch = BlockAccessor.for_block(pa.Table.from_pylist(rows, schema=schema)).to_batch_format("numpy")

    class Shard:  # a Ray Train dataset shard (train or validation): one numpy batch, as iter_batches gives it
        def iter_batches(self, **kwargs):
            yield batch

    ray.train.get_dataset_shard = lambda name: Shard()
    ray.train.get_context = lambda: types.SimpleNamespace(get_world_rank=lambda: 0, get_world_size=lambda: 1)
    ray.train.torch.prepare_model = lambda model: model  # one worker: no DDP wrapper
    ray.train.torch.get_device = lambda: torch.device("cpu")
    ray.train.get_checkpoint = lambda: None  # a first run: nothing to resume from
    ray.train.report = lambda metrics, checkpoint=None: None  # no controller to report to
    import eagle_data.training.stream_gate as stream_gate  # the gate is a Ray actor of a running stream: its batches as they are
    stream_gate.stream_batches = lambda shard, name, *, batch_size, **kwargs: shard.iter_batches(batch_size=batch_size)
    train_loop(config)
    with open(os.path.join(config["save_path"], "metrics.jsonl")) as f:
        result["metrics"] = [json.loads(line) for line in f]
    result["saved"] = sorted(os.listdir(os.path.join(config["save_path"], "final")))

def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None

result["modules"] = {m: sys.modules[m].__file__ for m in ("eagle_data", "ray_jobs", "speculators", "torch")
                     if m in sys.modules}
result["versions"] = {name: version(name) for name in ("torch", "transformers", "datasets", "speculators",
                                                       "hs-connectors", "torchvision", "torchaudio", "accelerate",
                                                       "vllm", "eagle-data")}
print(json.dumps(result))
"""


def cluster_install_commands() -> list[str]:
    """cluster.yaml's setup_commands that install Python packages, in order."""
    setup = yaml.safe_load((REPO / "cluster.yaml").read_text())["setup_commands"]
    return [c for c in setup if "pip install" in c or "install_draft.sh" in c]


def run(argv: list, env: dict, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def install_as_the_cluster(venv: Path, source: Path, env: dict) -> None:
    """cluster.yaml's two install commands into `venv`, from the project copy `source`, with
    the CPU torch for the vllm extra (the module docstring says why)."""
    project, draft = cluster_install_commands()
    assert project == 'python3 -m pip install -U "$HOME/eagle-data[vllm]"', project
    assert draft == 'bash "$HOME/eagle-data/scripts/install_draft.sh" python3 vllm', draft
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "venv", venv], env, source)
    pip = [python, "-m", "pip", "install", "-q", "--no-compile", "-c", CONSTRAINTS]
    first = subprocess.run([str(a) for a in [*pip, "-U", source, TORCH_CPU]], cwd=source, env=env,
                           capture_output=True, text=True, timeout=900)
    if first.returncode and f"No matching distribution found for {TORCH_CPU}" in first.stderr:
        # No local CPU wheel (as scripts/setup_venv.sh): PyTorch's CPU index has it.
        run([*pip, "--extra-index-url", TORCH_CPU_INDEX, "-U", source, TORCH_CPU], env, source)
    else:
        assert first.returncode == 0, first.stderr[-5000:]
    run(["bash", source / "scripts" / "install_draft.sh", python, "", "-q", "--no-compile", "-c", CONSTRAINTS],
        env, source)


def test_the_clusters_install_runs_the_draft_trainer_from_the_uploaded_copy(deep_qwen3, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RAY_ADDRESS", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    # What `ray job submit --working-dir .` unpacks on the node: the streaming doc's runtime_env.
    (tmp_path / "upload").mkdir()
    job = ray_upload(tmp_path / "upload", {"excludes": ["/.venv/", "/out/"]})
    source = shutil.copytree(job, tmp_path / "eagle-data")  # cluster.yaml's file_mounts copy
    venv = tmp_path / "venv"
    started = time.monotonic()
    try:
        install_as_the_cluster(venv, source, env)
        installed = time.monotonic()
        python = venv / "bin" / "python"

        out = write_out(tmp_path / "out", [synthetic_row(i, 3, 2, 4, "stop", "sample") for i in range(20)], 10)
        settings = job_settings(out, deep_qwen3, hidden_states__dtype="float32")
        settings["train"] = {"workers": 1, "device": "cpu", "cpus_per_worker": 0, "batch_size": 2, "speculators": {
            "trainer": {"epochs": 1, "max_steps": 1, "save_path": str(tmp_path / "draft")},
            "loss": {"loss_implementation": "eager"},
            "draft": {"draft_vocab_size": 256, "draft_attn_impl": "eager"}}}
        config = tmp_path / "train.yaml"
        config.write_text(yaml.safe_dump(settings))

        checked = run([python, "-c", WORKER_CHECK, config, ",".join(TRAINER_FILES)], env, job, timeout=600)
        result = json.loads(checked.stdout.splitlines()[-1])
        assert result["failed"] == {}, f"the cluster's install misses what the trainer imports: {result['failed']}"
        # The entry point as `ray job submit -- python -m ray_jobs.train_draft` starts it.
        usage = run([python, "-m", "ray_jobs.train_draft", "--help"], env, job, timeout=300)
        assert usage.stdout.startswith("usage: python -m ray_jobs.train_draft")
        print(f"install {installed - started:.0f}s, checks {time.monotonic() - installed:.0f}s")
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # ~1.5 GB

    # The project's code is the uploaded copy's; the installed packages are the venv's.
    for module in ("eagle_data", "ray_jobs"):
        assert Path(result["modules"][module]).resolve().is_relative_to(job.resolve()), result["modules"]
    for module in ("speculators", "torch"):
        assert Path(result["modules"][module]).is_relative_to(venv), result["modules"]
    # The project's pins, not speculators' (transformers<=5.19, datasets<=5.1), its declared
    # torchvision/torchaudio left out, the CPU torch, and no package of the `cpu` extra.
    versions = result["versions"]
    assert versions == {"torch": "2.13.0+cpu", "transformers": "5.24.0", "datasets": "5.2.0", "speculators": "0.9.0",
                        "hs-connectors": "0.9.0", "torchvision": None, "torchaudio": None, "accelerate": None,
                        "vllm": None, "eagle-data": versions["eagle-data"]}
    assert versions["eagle-data"] is not None  # the project itself, as the cluster installs it
    # One step of the worker's loop (its schedule, then the validation of the held-out rows):
    # finite losses, and the draft saved as speculators saves it.
    [step] = [m for m in result["metrics"] if "validation" not in m]
    assert step["step"] == 1 and step["rows"] == 2 and 0 < step["loss"] < float("inf") and step["lr"] > 0, step
    [validation] = [m["validation"] for m in result["metrics"] if "validation" in m]
    assert 0 < validation["loss"] < float("inf"), validation
    assert {"config.json", "model.safetensors"} <= set(result["saved"]), result["saved"]
