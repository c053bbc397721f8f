"""Multi-turn generation (`prompt.turns: all`) on vLLM's CPU build: model loads per run and
where the wall time goes, for this checkout (and, with --compare-rev, another revision).

    .venv/bin/python benchmarks/multi_turn_loads.py [--conversations 48] [--turns 3]
        [--max-tokens 32] [--compare-rev REV] [--smoke]

Each conversation has --turns user turns (ShareGPT rows), so the job answers --turns depths;
depth d is asked once depth d-1's answers are published. Each revision runs the same
command a user runs (`python -m ray_jobs.generate --config FILE`, its own local Ray, or the
instance at RAY_ADDRESS when that is set, as in the test suite's smoke run) on the
same rows, model and config, from a clean tree (--compare-rev is extracted with `git
archive`). Model loads are counted twice, from what each run leaves: the manifest's
`engine_load_s` (the driver's record of each spell of replicas loading the model) and vLLM's
own "Initializing a V1 LLM engine" line in the job's output (one per engine started). Each
OUT must pass `python -m eagle_data verify` (every answer exactly once).
`--smoke` runs this checkout alone at a tiny size (tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import yaml

from _workload import REPO, one_engine_thread, qwen3_dir

WORDS = [" the", " cat", " sat", " on", " mat", " and", " dog", " ran", "."]
ENGINE_STARTED = re.compile(r"Initializing a V1 LLM engine")


def conversations(path: Path, n: int, turns: int) -> Path:
    rows = [{"conversations": [m for t in range(turns) for m in (
        {"from": "human", "value": f"Question {t} of conversation {i}: what did the cat do next?"},
        {"from": "gpt", "value": "(the dataset's answer, never used)"})], "source": "bench"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_config(path: Path, out: Path, rows: Path, model: Path, args) -> Path:
    kwargs = {"dtype": "bfloat16", "enforce_eager": True, "max_num_seqs": 16}
    settings = {
        "source": {"dataset": str(rows)},
        "model": {"path": str(model)},
        "prompt": {"turns": "all"},
        "engine": {"backend": "vllm", "device": "cpu", "cpu_kv_cache_gib": 0.5, "max_model_len": 1024,
                   "batch_size": 4, "max_concurrent_batches": 10, "engine_kwargs": kwargs,
                   "cpu_threads": one_engine_thread()},
        "sampling": {"max_tokens": args.max_tokens, "temperature": 1.0, "top_p": 1.0, "seed": 0},
        "output": {"path": str(out), "rows_per_shard": 64, "log_every_s": 3600},
    }
    path.write_text(yaml.safe_dump(settings))
    return path


def run_job(tree: Path, config: Path, out: Path) -> dict:
    """One run of the job's command from `tree`; what it did, from its output and manifest."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ray_jobs.generate", "--config", str(config)], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree), "RAY_DATA_DISABLE_PROGRESS_BARS": "1"},
                          capture_output=True, text=True)
    wall = time.monotonic() - started
    printed = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"the job from {tree} exited {proc.returncode}:\n{printed[-4000:]}")
    verify = subprocess.run([sys.executable, "-m", "eagle_data", "verify", str(out)], cwd=tree,
                            env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    if verify.returncode != 0:  # every answer once, every count consistent
        raise SystemExit(f"verify of the run from {tree} failed:\n{(verify.stdout + verify.stderr)[-4000:]}")
    generate = json.loads((out / "manifest.json").read_text())["phases"]["generate"]["runs"][-1]
    return {"wall_s": wall, "generate_s": generate["wall_s"], "load_spells": generate.get("engine_load_s", []),
            "engines_started": len(ENGINE_STARTED.findall(printed)), "ok": generate["ok"],
            "tokens": generate["generated_tokens"]}


def same_answers(a: Path, b: Path) -> tuple[int, int]:
    """(answers whose input_ids are equal in both OUTs, answers in the first)."""
    import pyarrow.dataset as pads

    def ids(out: Path) -> dict:
        table = pads.dataset(sorted((out / "data").glob("*.parquet"))).to_table(columns=["sample_id", "input_ids"])
        return dict(zip(table.column("sample_id").to_pylist(), table.column("input_ids").to_pylist()))

    first, second = ids(a), ids(b)
    return sum(second.get(k) == v for k, v in first.items()), len(first)


def extract(rev: str, dest: Path) -> Path:
    archive = dest.with_suffix(".tar")
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), rev], cwd=REPO, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=3, help="user turns per conversation = turn depths")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--compare-rev", help="also run this revision (git archive) on the same rows")
    parser.add_argument("--smoke", action="store_true", help="4 conversations x 2 turns, this checkout only")
    args = parser.parse_args()
    if args.smoke:
        args.conversations, args.turns, args.max_tokens, args.compare_rev = 4, 2, 8, None

    sys.path.insert(0, str(REPO / "tests"))
    from support import build_babbling_model

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        p_stop = 1 / 16
        probs = {**{w: (1 - p_stop) / len(WORDS) for w in WORDS}, "<|im_end|>": p_stop}
        model = build_babbling_model(qwen3_dir(tmp), tmp / "babble", ["<|im_end|>", "<|endoftext|>"], probs, head_dim=64)
        rows = conversations(tmp / "chats.jsonl", args.conversations, args.turns)
        trees = [("this checkout", REPO)]
        if args.compare_rev:
            trees.append((args.compare_rev, extract(args.compare_rev, tmp / "baseline")))
        results = []
        for i, (name, tree) in enumerate(trees):
            out = tmp / f"out-{i}"
            results.append((name, run_job(tree, job_config(tmp / f"job-{i}.yaml", out, rows, model, args), out)))
            print(f"{name}: {json.dumps(results[-1][1])}", flush=True)
        same = same_answers(tmp / "out-0", tmp / "out-1") if len(trees) == 2 else None

    print(f"\nworkload: {args.conversations} conversations x {args.turns} user turns "
          f"({args.conversations * args.turns} answers), max_tokens {args.max_tokens}, vLLM CPU, 1 replica")
    print("\n| run | model loads (manifest) | engines started (vLLM log) | load s | generate s | job wall s | "
          "answers | generated tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results:
        print(f"| {name} | {len(r['load_spells'])} | {r['engines_started']} | {sum(r['load_spells']):.0f} | "
              f"{r['generate_s']:.0f} | {r['wall_s']:.0f} | {r['ok']} | {r['tokens']} |")
    if len(results) == 2:
        (_, new), (_, old) = results
        print(f"\ngenerate phase, {args.compare_rev} / this checkout: {old['generate_s'] / new['generate_s']:.2f}x; job wall "
              f"{old['wall_s'] / new['wall_s']:.2f}x; loads per run {len(old['load_spells'])} -> {len(new['load_spells'])}")
    if same is not None:
        print(f"answers with the same token ids in both runs (same seeds): {same[0]}/{same[1]}")
    print(f"loads per run (this checkout): {len(results[0][1]['load_spells'])}")


if __name__ == "__main__":
    main()
