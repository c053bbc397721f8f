"""The job against bare vLLM: generated tokens per second of engine time, through the whole
generate phase (requests, Ray's vLLM stage, postprocess, shard writers), vs
`vllm.LLM.generate` on the same tokenized prompts. vLLM's CPU build, one replica.

    .venv/bin/python benchmarks/vllm_vs_job.py [--rows 192] [--max-tokens 256] [--mean 48]
        [--slots 16] [--settings default naive] [--smoke]

Same model, prompts, engine kwargs and sampling (temperature 1, the job's per-row seeds) on
both sides, so both generate the same tokens. The model is a "babbling" Qwen3 (head_dim 64,
real Qwen3 tokenizer): its next-token distribution is fixed, with p(eos) = 1/--mean, so
completion lengths are geometric (long-tailed), capped by --max-tokens.

Engine time: bare vLLM = the `generate` call; the job = first request queued in the engine
to last token, from vLLM's per-request metrics that Ray's stage returns (its engine has one
clock). Model load (and, for the job, Ray and the pipeline starting) is reported separately.
Settings: `default` = the project's feeding rule (batch 4, batch_size x max_concurrent_batches
= (2 + 4/8) x slots rows in flight, see eagle_data/job/stages/engines/vllm_backend.py); `naive` = one
batch of `slots` rows at a time (max_concurrent_batches 1): the engine idles while each
batch's slowest row finishes.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from _workload import REPO, qwen3_dir, write_chat_rows  # noqa: E402

WORDS = [" the", " cat", " sat", " on", " mat", " and", " dog", " ran", "."]


def engine_kwargs(args) -> dict:
    """The pass-through both engines get (the job's max_model_len is its typed key)."""
    return {"dtype": "bfloat16", "enforce_eager": True, "max_num_seqs": args.slots}


def bare_vllm(spec_path: str, result_path: str) -> None:
    """The child process: vllm.LLM on the prompts of the base OUT (its engine process is
    spawned, so this runs under the __main__ guard)."""
    import pyarrow.dataset as pads
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_data.job.stages.requests import row_seed

    spec = json.loads(Path(spec_path).read_text())
    prompts = pads.dataset(sorted(Path(spec["out"], "prompts").glob("*.parquet"))).to_table(
        columns=["sample_id", "tokenized_prompt"]).to_pylist()
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], kv_cache_memory_bytes=2**29, **spec["engine_kwargs"])
    load = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=spec["max_tokens"], temperature=1.0, top_p=1.0, seed=row_seed(0, p["sample_id"]),
                             stop_token_ids=spec["stop_ids"], detokenize=False) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p["tokenized_prompt"])) for p in prompts], params,
                        use_tqdm=False)
    engine_s = time.perf_counter() - t0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    Path(result_path).write_text(json.dumps({"load_s": load, "engine_s": engine_s, "tokens": sum(lengths),
                                             "rows": len(outs), "max_len": max(lengths)}))


def timed_engine(events: str):
    """The configured engine stage (Ray's vLLM stage) + a step recording each batch's vLLM
    request metrics."""
    from eagle_data.job.stages.engines import apply_engine

    def record(batch, path):
        metrics = [m for m in batch.column("metrics").to_pylist() if m]
        with open(path, "a") as f:
            f.write(json.dumps({"queued": min(m["queued_ts"] for m in metrics),
                                "last": max(m["last_token_ts"] for m in metrics),
                                "arrival": min(m["arrival_time"] for m in metrics),
                                "tokens": sum(batch.column("num_generated_tokens").to_pylist())}) + "\n")
        return batch

    def stage(ds, cfg, pad_id):
        return apply_engine(ds, cfg, pad_id).map_batches(record, batch_format="pyarrow", fn_kwargs={"path": events})

    return stage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--mean", type=float, default=48, help="mean completion length before the cap (1/p(eos))")
    parser.add_argument("--slots", type=int, default=16, help="max_num_seqs")
    parser.add_argument("--settings", nargs="+", default=["default", "naive"], choices=["default", "naive"])
    parser.add_argument("--smoke", action="store_true", help="8 rows, 16 tokens, default feeding only")
    parser.add_argument("--bare", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        return bare_vllm(*args.bare)
    if args.smoke:
        args.rows, args.max_tokens, args.mean, args.slots, args.settings = 8, 16, 8, 4, ["default"]

    sys.path.insert(0, str(REPO / "tests"))
    from support import build_babbling_model

    import ray

    from eagle_data.config import load_config
    from eagle_data.job.phases.generate import target_tokens
    from eagle_data.job.phases.run import run
    from eagle_data.model_files import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        p_stop = 1 / args.mean
        probs = {**{w: (1 - p_stop) / len(WORDS) for w in WORDS}, "<|im_end|>": p_stop}
        model = build_babbling_model(qwen3_dir(tmp), tmp / "babble", ["<|im_end|>", "<|endoftext|>"], probs, head_dim=64)
        write_chat_rows(tmp / "rows.jsonl", args.rows, (5, 40))
        kwargs = engine_kwargs(args)
        base = [f"source.dataset={tmp / 'rows.jsonl'}", f"model.path={model}", "engine.backend=vllm",
                "engine.device=cpu", "engine.cpu_kv_cache_gib=0.5", f"engine.engine_kwargs={json.dumps(kwargs)}",
                "engine.max_model_len=1024", f"sampling.max_tokens={args.max_tokens}", "sampling.temperature=1.0",
                "sampling.top_p=1.0", "sampling.seed=0", "output.rows_per_shard=64", "output.log_every_s=3600"]
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        logging.getLogger("ray").setLevel(logging.WARNING)
        base_cfg = load_config(None, base + [f"output.path={tmp / 'base'}"])
        prompts = run(base_cfg, phase="prompts")["prompts"]
        stop_ids = list(target_tokens(base_cfg, load_tokenizer(str(model))).eos_ids)  # what the job asks for

        spec = tmp / "bare.json"
        spec.write_text(json.dumps({"out": str(tmp / "base"), "model": str(model),
                                    "engine_kwargs": {**kwargs, "max_model_len": 1024},
                                    "max_tokens": args.max_tokens, "stop_ids": stop_ids}))
        subprocess.run([sys.executable, __file__, "--bare", str(spec), str(tmp / "bare-result.json")], check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
        bare = json.loads((tmp / "bare-result.json").read_text())
        bare_rate = bare["tokens"] / bare["engine_s"]
        print(f"workload: {prompts['prompts']} prompts, geometric lengths mean {args.mean:g} capped at "
              f"{args.max_tokens} (longest {bare['max_len']}), max_num_seqs {args.slots}", flush=True)

        rows = [("bare vLLM (LLM.generate)", "-", bare["tokens"], bare["engine_s"], bare_rate, 1.0, bare["load_s"])]
        for setting in args.settings:
            b, c = (4, math.ceil((2 + 4 / 8) * args.slots / 4)) if setting == "default" else (args.slots, 1)
            out = tmp / f"out-{setting}"
            shutil.copytree(tmp / "base", out)
            events = tmp / f"events-{setting}.jsonl"
            cfg = load_config(None, base + [f"output.path={out}", f"engine.batch_size={b}",
                                            f"engine.max_concurrent_batches={c}"])
            started = time.time()
            counts = run(cfg, phase="generate", engine=timed_engine(str(events)))["generate"]
            calls = [json.loads(line) for line in events.read_text().splitlines()]
            tokens = sum(c_["tokens"] for c_ in calls)
            engine_s = max(c_["last"] for c_ in calls) - min(c_["queued"] for c_ in calls)
            load_s = min(c_["arrival"] for c_ in calls) - started
            assert counts["ok"] == prompts["prompts"], counts
            rows.append((f"job, {setting} feeding", f"{b}x{c}", tokens, engine_s, tokens / engine_s,
                         tokens / engine_s / bare_rate, load_s))
        ray.shutdown()

    print("\n| run | batch x concurrent | generated tokens | engine s | tokens/s | vs bare | load s |")
    print("|---|---|---|---|---|---|---|")
    for name, bc, tokens, engine_s, rate, ratio, load in rows:
        print(f"| {name} | {bc} | {tokens} | {engine_s:.1f} | {rate:.0f} | {ratio:.2f} | {load:.0f} |")
    if any(r[2] != bare["tokens"] for r in rows):
        print("note: the job generated a different number of tokens than bare vLLM")


if __name__ == "__main__":
    main()
