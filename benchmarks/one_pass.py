"""Features in the generating pass ("one pass") against generating, then a prefill-only pass
over prompt + answer ("two passes", what the hidden-states phase does), on bare vLLM (CPU
build), greedy and sampled; and whether one-pass answers follow the target's own
distribution.

    .venv/bin/python benchmarks/one_pass.py [--rows 48] [--gen 128 512] [--slots 16]
        [--samples 1000] [--prompts 3] [--scale 30] [--vllm-fix] [--smoke]

One pass: the engine runs vLLM's `extract_hidden_states` speculative method with the
project's connector (vllm_hidden_states.hidden_states_engine_kwargs), and each generating
request sets `kv_transfer_params.include_output_tokens`: its file then holds the states of
the prompt and of every generated token but the last. The method proposes each step's first
sampled token as the next step's one draft token, so every decode step verifies a draft
through vLLM's rejection sampler (no draft probabilities, as for n-gram drafts: accepted with
the target's probability of it, else a token drawn from the target's distribution without
it), which is what could change the answers.

The target: the 8-layer Qwen3 shape of the vLLM tests (H 64, random weights, float32) with
a vocabulary of 8,192 tokens and its untied output layer scaled (x --scale), so that each
next-token distribution is peaked and depends on the context (a random model's is near
uniform, which no sample size tells apart). Prompts are token ids of real English text
(Qwen3's), folded into the vocabulary. Two engines in child processes, `vllm.LLM` each:
plain (no method: the generate phase's engine) and one pass (the method: the hidden-states
phase's engine); with --vllm-fix a third, the method corrected as vLLM's open PR #56442
proposes (_extract_feedback_fix.py).

1. Cost: --rows prompts of 8-63 tokens, each answering a seeded length uniform in --gen
   (ignore_eos), max_num_seqs --slots, greedy and sampled (temperature 1.0, top_p 0.95,
   configs/kimi-k2.5.yaml's, a seed per request). Two passes = plain generate + a second,
   prefill-only pass over prompt + answer on the method's engine (one file per row). Timed:
   each generate call until every file is written. Also shown: whether the greedy one-pass
   answers equal the plain ones, how often a token follows itself, and whether the
   one-pass states equal a second pass over the same sequence (float32, relative 1e-5) on
   every position they have.
2. Distribution: --prompts prompts x --samples seeded requests of 3 tokens, temperature 1.0,
   top_p 0.95. Chi-square homogeneity tests per prompt on the first, second and third token
   and on the (first, second) pair (categories with fewer than 5 expected pooled), each
   setting against plain: one pass; plain with other seeds (what the test gives when nothing
   differs); plain at temperature 0.8 (a difference it must find).
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from _workload import REPO, qwen3_dir, text_pool_ids  # noqa: E402

LAYER_IDS = [2, 4, 5, 8]
VOCAB = 8192  # sampling over Qwen3's 151k tokens costs 16 ms a token on this CPU, 30x the model
SAMPLED = {"temperature": 1.0, "top_p": 0.95}


def engine_kwargs(model: str, slots: int, max_len: int, one_pass: bool = False, scratch: str = "",
                  fixed: bool = False) -> dict:
    """The job's engine kwargs for a CPU replica, with the hidden-states method or without;
    `fixed`: with vLLM's proposed fix of the method (_extract_feedback_fix.py)."""
    from eagle_data.config import load_config
    from eagle_data.job.stages.engines.vllm_backend import engine_kwargs as job_engine_kwargs
    from eagle_data.job.stages.engines.vllm_hidden_states import hidden_states_engine_kwargs

    cfg = load_config(None, [
        f"model.path={model}", "output.path=/tmp/unused", "engine.backend=vllm", "engine.device=cpu",
        f"sampling.max_tokens={max_len // 2}",
        "engine.cpu_kv_cache_gib=1", f"engine.max_model_len={max_len}",
        f"engine.engine_kwargs={json.dumps({'enforce_eager': True, 'max_num_seqs': slots})}"])
    kwargs = {**job_engine_kwargs(cfg), "dtype": "float32", "skip_tokenizer_init": True}
    if not one_pass:
        return kwargs
    kwargs.update(hidden_states_engine_kwargs(LAYER_IDS, "float32", scratch))
    if fixed:
        kwargs["kv_transfer_config"]["kv_connector_module_path"] = "_extract_feedback_fix"
    return kwargs


def engine_child(spec_path: str, result_path: str) -> None:
    """One `vllm.LLM` (its engine process is spawned, so this runs under the __main__ guard)
    and the runs the spec lists, in order. A run: `name`; `prompts` (token ids), or None and
    `prompts_from`, an earlier run whose prompts + answers it takes; `params`, one per prompt
    or one for all; `files`, None or a folder for one hidden-states file per request, with
    `include_output_tokens`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], **spec["engine_kwargs"])
    warm = [TokensPrompt(prompt_token_ids=list(range(1000, 1064)))]
    llm.generate(warm, [SamplingParams(max_tokens=2, detokenize=False)], use_tqdm=False)  # first-call costs
    results = {}
    for run in spec["runs"]:
        prompts = run["prompts"]
        if prompts is None:  # an earlier run's prompts + answers; a name not run yet is a KeyError
            earlier = results[run["prompts_from"]]
            prompts = [p + a for p, a in zip(earlier["prompts"], earlier["answers"])]
        params = []
        for i, p in enumerate(run["params"] if isinstance(run["params"], list) else [run["params"]] * len(prompts)):
            extra = None
            if run["files"]:
                extra = {"kv_transfer_params": {"hidden_states_path": f"{run['files']}/{i}.safetensors",
                                                "include_output_tokens": run.get("include_output_tokens", False)}}
            params.append(SamplingParams(**p, detokenize=False, extra_args=extra))
        started = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        if run["files"]:
            for i in range(len(prompts)):  # the connector holds <path>.lock exclusively while it writes
                with open(f"{run['files']}/{i}.safetensors.lock") as f:
                    fcntl.flock(f, fcntl.LOCK_SH)
        seconds = time.perf_counter() - started
        results[run["name"]] = {"seconds": seconds, "prompts": prompts,
                                "answers": [list(o.outputs[0].token_ids) for o in outputs]}
    Path(result_path).write_text(json.dumps(results))


def run_engine(tmp: Path, name: str, model: str, kwargs: dict, runs: list[dict]) -> dict:
    spec, result = tmp / f"{name}.json", tmp / f"{name}-result.json"
    spec.write_text(json.dumps({"model": model, "engine_kwargs": kwargs, "runs": runs}))
    subprocess.run([sys.executable, __file__, "--engine", str(spec), str(result)], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'benchmarks'}"})
    return json.loads(result.read_text())


def load_states(path: str):
    from safetensors.torch import load_file

    t = load_file(path)
    return t["hidden_states"], t["token_ids"].tolist()


def peaked_model(dest: Path, scale: float) -> Path:
    """The 8-layer Qwen3 shape of the vLLM tests (H 64) with a vocabulary of VOCAB tokens and
    an untied output layer scaled by `scale`; no tokenizer (the engines skip it)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from support import tiny_qwen3_config

    torch.manual_seed(1)
    model = Qwen3ForCausalLM(tiny_qwen3_config(VOCAB, 64, tie_word_embeddings=False, layers=8))
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(dest)
    return dest


def chi2_homogeneity(a: list, b: list) -> float:
    """Chi-square test that two samples come from one distribution: its p-value; categories
    with an expected count below 5 in either sample are pooled."""
    import torch

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    cells, pooled = [], [0, 0]
    for k in keys:
        total = ca[k] + cb[k]
        if min(total * na, total * nb) / (na + nb) >= 5:
            cells.append((ca[k], cb[k]))
        else:
            pooled[0] += ca[k]
            pooled[1] += cb[k]
    if sum(pooled):
        cells.append(tuple(pooled))
    if len(cells) < 2:
        return 1.0
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def workload(args, pool: np.ndarray) -> dict:
    """The cost runs' prompts and sampling, and the distribution's prompts."""
    rng = np.random.default_rng(0)
    prompts = [pool[s:s + int(n)].tolist() for s, n in zip(rng.integers(0, len(pool) - 64, args.rows),
                                                             rng.integers(8, 64, args.rows))]
    lengths = rng.integers(args.gen[0], args.gen[1] + 1, args.rows).tolist()
    modes = {"greedy": [{"max_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in lengths],
             "sampled": [{"max_tokens": n, **SAMPLED, "seed": i, "ignore_eos": True} for i, n in enumerate(lengths)]}
    every = [pool[k * 997:k * 997 + 12 + 5 * k].tolist() for k in range(args.prompts) for _ in range(args.samples)]

    def draws(seed0: int, temperature: float) -> list[dict]:
        return [{"max_tokens": 3, "temperature": temperature, "top_p": SAMPLED["top_p"], "seed": seed0 + i,
                 "ignore_eos": True} for i in range(len(every))]

    return {"prompts": prompts, "lengths": lengths, "modes": modes, "every": every,
            "plain": draws(0, 1.0), "other_seeds": draws(10**6, 1.0), "cooler": draws(0, 0.8)}


def cost_lines(args, w: dict, plain: dict, ones: dict[str, dict], scratch: Path) -> list[str]:
    tokens = sum(w["lengths"])
    lines = [f"cost: {args.rows} rows, {tokens} generated tokens (uniform in {args.gen}, prompts 8-63 tokens), "
             f"layer ids {LAYER_IDS} of 8, H 64, float32, max_num_seqs {args.slots}, {os.cpu_count()} cores",
             "", "| sampling | engine | plain s | second pass s | two passes s | one pass s | one pass / two passes |",
             "|---|---|---|---|---|---|---|"]
    for m in w["modes"]:
        for name, r in ones.items():
            p, s, o = plain[m]["seconds"], r[f"second-plain-{m}"]["seconds"], r[f"one-{m}"]["seconds"]
            lines.append(f"| {m} | {name} | {p:.2f} | {s:.2f} | {p + s:.2f} | {o:.2f} | **{o / (p + s):.2f}** |")
    lines += ["", "| engine | greedy answers equal plain's | a token repeated at once, per 1000 tokens, greedy / "
              "sampled (plain: {} / {}) | rows whose states differ from a second pass (> 1e-5 relative) | largest "
              "difference |".format(*(repeats(plain[m]["answers"]) for m in w["modes"])),
              "|---|---|---|---|---|"]
    for name, r in ones.items():
        same = sum(a == b for a, b in zip(plain["greedy"]["answers"], r["one-greedy"]["answers"]))
        worst, off = 0.0, 0
        for m in w["modes"]:
            for i, (pr, a) in enumerate(zip(w["prompts"], r[f"one-{m}"]["answers"])):
                states, ids = load_states(f"{scratch}/{name}/one-{m}/{i}.safetensors")
                full, full_ids = load_states(f"{scratch}/{name}/second-{m}/{i}.safetensors")
                assert ids == (pr + a)[:-1] and full_ids == pr + a, (name, m, i)
                rel = float((states - full[:-1]).abs().max() / full[:-1].abs().max())
                worst, off = max(worst, rel), off + (rel > 1e-5)
        lines.append(f"| {name} | {same} of {args.rows} | " + " / ".join(
            repeats(r[f"one-{m}"]["answers"]) for m in w["modes"]) +
            f" | {off} of {2 * args.rows} | {worst:.1e} |")
    return lines


def repeats(answers: list[list[int]]) -> str:
    """How often a token follows itself, per 1000 generated tokens."""
    same = sum(a == b for answer in answers for a, b in zip(answer, answer[1:]))
    return f"{1000 * same / max(sum(len(a) - 1 for a in answers), 1):.1f}"


def distribution_lines(args, w: dict, plain: dict, ones: dict[str, dict]) -> list[str]:
    n = args.samples

    def by_prompt(answers: list[list[int]]) -> list[list[list[int]]]:
        return [answers[k * n:(k + 1) * n] for k in range(args.prompts)]

    samples = {**{name: by_prompt(r["dist-one"]["answers"]) for name, r in ones.items()},
               "plain": by_prompt(plain["dist-plain"]["answers"]),
               "plain, other seeds": by_prompt(plain["dist-other-seeds"]["answers"]),
               "plain, temperature 0.8": by_prompt(plain["dist-cooler"]["answers"])}
    stats = {"token 1": lambda a: a[0], "token 2": lambda a: a[1], "token 3": lambda a: a[2],
             "tokens (1, 2)": lambda a: (a[0], a[1])}
    entropy = [-sum(v / n * math.log(v / n) for v in Counter(a[0] for a in s).values()) for s in samples["plain"]]
    distinct = [len(set(a[0] for a in s)) for s in samples["plain"]]
    lines = [f"distribution: {args.prompts} prompts x {n} seeded requests of 3 tokens per setting, temperature "
             f"{SAMPLED['temperature']}, top_p {SAMPLED['top_p']}; output layer x{args.scale}: first-token "
             f"entropy {min(entropy):.2f}-{max(entropy):.2f} nats, {min(distinct)}-{max(distinct)} distinct "
             "first tokens per prompt; chi-square homogeneity per prompt on token 1, 2, 3 and (1, 2)",
             "", "| against plain (temperature 1.0) | tests | p < 0.01 | smallest p | median p | token 2 = token 1 |",
             "|---|---|---|---|---|---|"]
    for name in (*ones, "plain, other seeds", "plain, temperature 0.8"):
        ps = [chi2_homogeneity([stat(a) for a in samples[name][k]], [stat(a) for a in samples["plain"][k]])
              for k in range(args.prompts) for stat in stats.values()]
        again = sum(a[1] == a[0] for s in samples[name] for a in s)
        lines.append(f"| {name} | {len(ps)} | {sum(p < 0.01 for p in ps)} | {min(ps):.2g} | "
                     f"{float(np.median(ps)):.2g} | {again} of {len(w['every'])} |")
    lines.append(f"(plain: token 2 = token 1 in {sum(a[1] == a[0] for s in samples['plain'] for a in s)} of "
                 f"{len(w['every'])}; the sampling runs took {plain['dist-plain']['seconds']:.1f} s plain, "
                 + ", ".join(f"{r['dist-one']['seconds']:.1f} s {name}" for name, r in ones.items()) + ")")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--gen", type=int, nargs=2, default=[128, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--slots", type=int, default=16, help="max_num_seqs of every engine")
    parser.add_argument("--samples", type=int, default=1000, help="requests per prompt and setting")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--scale", type=float, default=30.0, help="the target's output-layer scale")
    parser.add_argument("--smoke", action="store_true", help="4 rows of 8-24 tokens; 2 prompts x 100 samples")
    parser.add_argument("--vllm-fix", action="store_true",
                        help="also one pass with vLLM's proposed fix of the method (_extract_feedback_fix.py)")
    parser.add_argument("--engine", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        return engine_child(*args.engine)
    if args.smoke:
        args.rows, args.gen, args.slots, args.samples, args.prompts = 4, [8, 24], 4, 100, 2

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        pool = text_pool_ids(AutoTokenizer.from_pretrained(qwen3_dir(tmp))) % VOCAB
        w = workload(args, pool)
        model = str(peaked_model(tmp / "model", args.scale))
        max_len = 1 << math.ceil(math.log2(args.gen[1] + 64 + 1))
        plain = run_engine(tmp, "plain", model, engine_kwargs(model, args.slots, max_len), [
            *({"name": m, "prompts": w["prompts"], "params": p, "files": None} for m, p in w["modes"].items()),
            {"name": "dist-plain", "prompts": w["every"], "params": w["plain"], "files": None},
            {"name": "dist-other-seeds", "prompts": w["every"], "params": w["other_seeds"], "files": None},
            {"name": "dist-cooler", "prompts": w["every"], "params": w["cooler"], "files": None}])
        scratch, extract = tmp / "scratch", {"max_tokens": 1, "temperature": 0.0}
        ones = {}
        engines = {"one pass": False, **({"one pass, vLLM's proposed fix": True} if args.vllm_fix else {})}
        for name, fixed in engines.items():
            files = scratch / name
            runs = []
            for m, p in w["modes"].items():
                runs += [{"name": f"one-{m}", "prompts": w["prompts"], "params": p, "files": f"{files}/one-{m}",
                          "include_output_tokens": True},
                         # a second pass over the one-pass sequences: the states check
                         {"name": f"second-{m}", "prompts": None, "prompts_from": f"one-{m}", "params": extract,
                          "files": f"{files}/second-{m}"},
                         # the second pass of the two-pass way, over the plain run's answers: its cost
                         {"name": f"second-plain-{m}", "params": extract, "files": f"{files}/second-plain-{m}",
                          "prompts": [pr + a for pr, a in zip(w["prompts"], plain[m]["answers"])]}]
            runs.append({"name": "dist-one", "prompts": w["every"], "params": w["plain"], "files": f"{files}/dist",
                         "include_output_tokens": True})
            ones[name] = run_engine(tmp, f"one-pass-{int(fixed)}", model,
                                    engine_kwargs(model, args.slots, max_len, True, str(files), fixed), runs)
        print("\n".join(cost_lines(args, w, plain, ones, scratch)), flush=True)
        print("\n" + "\n".join(distribution_lines(args, w, plain, ones)))


if __name__ == "__main__":
    main()
