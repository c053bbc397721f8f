"""Does the job keep the engine's slots busy at a batch_size x max_concurrent_batches setting
(target: 90% of slot time)? A simulated continuous-batching engine in the engine's place, for
several settings (the project's rule: vllm_backend.py's `feed_factor`).

    .venv/bin/python benchmarks/engine_feeding.py [--slots 64] [--token-ms 1] [--measure-s 16]
        [--rows 2000] [--settings 64x1 16x6 4x24 16x16 16x64 naive]

The real job (`run`: the prompts phase once, with the real Qwen3 tokenizer on synthetic English
prompts, then the generate phase per setting on a copy of that OUT: requests, engine, the real
postprocess and shard writers) with `engine=` a stage mapped like the job maps Ray's vLLM stage
(eagle_data/job/stages/engines/vllm_backend.py: blocks of B rows, `map_batches(SimEngine,
batch_size=None, compute=ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=2*C),
max_concurrency=C)`). SimEngine is one replica: N slots (one asyncio semaphore shared by every
call, FIFO); a row holds a slot for its completion length x --token-ms (lengths from
_workload.py's long-tailed distribution, mean 1,300, cap 8,192, seeded per sample); a call
returns its batch when all its rows are done, as Ray's stage does, with valid Qwen3 ids
(<think> ... </think> ... <|im_end|>, no eos when capped) for the postprocess.

Utilisation = busy slot-time / (N x window); the window runs from the end of the ramp (the
stage first holds min(N, B x C) rows) to the last admission (the rest is the data's tail) or
--measure-s after the first admission (then the engine finishes the rest at once). The
baseline, in the same run: `naive`, one batch of every row (C = 1), which keeps the engine's
queue full from the start (but returns nothing before the end). "rows held" is the
time-averaged number of rows inside the engine stage, i.e. how many Ray Data kept in flight;
"held peak" the most rows done but not yet returned (what a kill would lose).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from _workload import MAX_TOKENS, MEAN_TOKENS, engine_output, length_of, own_ray, qwen3_dir, write_chat_rows  # noqa: E402

VOCAB_TEXT = 151643  # Qwen3: ids below this are ordinary text tokens


class SimEngine:
    """A simulated continuous-batching engine replica (see the module docstring)."""

    def __init__(self, slots: int, token_s: float, measure_s: float, events: str, think: int,
                 end: int, eos: int, seed: int = 0, mean_tokens: float = MEAN_TOKENS):
        self.mean_tokens = mean_tokens
        self.slots, self.token_s, self.measure_s, self.events = slots, token_s, measure_s, events
        self.think, self.end, self.eos, self.seed = think, end, eos, seed
        self.sem = None
        self.deadline = None  # first admission + measure_s

    async def _row(self, tokens: int) -> tuple[float, float]:
        async with self.sem:
            start = time.time()
            if self.deadline is None:
                self.deadline = start + self.measure_s
            remaining = self.deadline - start
            if remaining > 0:  # past the deadline: finish at once (measurement is over)
                await asyncio.sleep(min(tokens * self.token_s, remaining))
            return start, time.time()

    def _tokens(self, sample_id: str, n: int, max_tokens: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(sample_id[:12], 16), 1])
        ids = rng.integers(0, VOCAB_TEXT, n)
        if n >= max_tokens:  # cut inside the reasoning: no </think>, no eos
            ids[0] = self.think
            return ids
        ids[0], ids[-1] = self.think, self.eos
        if n >= 3:
            ids[1 + int(rng.integers(0, n - 2))] = self.end
        return ids

    async def __call__(self, batch: pa.Table):
        if self.sem is None:  # created on the actor's event loop, shared by all its calls
            self.sem = asyncio.Semaphore(self.slots)
        called = time.time()
        sample_ids = batch.column("sample_id").to_pylist()
        params = batch.column("sampling_params").to_pylist()
        lengths = [length_of(s, self.seed, mean=self.mean_tokens, max_tokens=p["max_tokens"])
                   for s, p in zip(sample_ids, params)]
        spans = await asyncio.gather(*(self._row(n) for n in lengths))
        returned = time.time()
        with open(self.events, "a") as f:
            f.write(json.dumps({"called": called, "returned": returned, "lengths": lengths,
                                "spans": spans}) + "\n")

        yield engine_output(batch, [self._tokens(s, n, p["max_tokens"]) for s, n, p in zip(sample_ids, lengths, params)])


def sim_stage_factory(slots: int, token_s: float, measure_s: float, events: str, special,
                      mean_tokens: float = MEAN_TOKENS):
    """`engine(ds, cfg, pad_id) -> ds` for run_generate, mapped like Ray's vLLM stage."""
    import ray

    def stage(ds, cfg, pad_id):
        c = cfg.engine.max_concurrent_batches
        return ds.map_batches(
            SimEngine,
            fn_constructor_kwargs=dict(slots=slots, token_s=token_s, measure_s=measure_s,
                                       events=events, think=special.reasoning_start_id,
                                       end=special.reasoning_end_id, eos=special.eos_ids[0],
                                       mean_tokens=mean_tokens),
            batch_size=None,  # each block is one engine batch, as the job's engine stages take them
            batch_format="pyarrow",
            zero_copy_batch=True,
            compute=ray.data.ActorPoolStrategy(size=cfg.engine.replicas,
                                               max_tasks_in_flight_per_actor=2 * c),
            max_concurrency=c,
            num_cpus=0.1,  # the engine holds GPUs in production, not the CPUs the rest needs
        )

    return stage


def analyse(calls: list[dict], slots: int, measure_s: float, in_flight: int) -> dict:
    """Window metrics from engine calls: {"called", "returned", "spans": [[admit, release], ...]}."""
    admit = np.array([s[0] for c in calls for s in c["spans"]])
    release = np.array([s[1] for c in calls for s in c["spans"]])
    returned = np.array([c["returned"] for c in calls for _ in c["spans"]])
    first = admit.min()
    # End of the ramp: the engine stage first holds enough rows to fill every slot (or all
    # B x C rows, when that is fewer), counting rows from a call's start to its return.
    called = np.array([c["called"] for c in calls])
    back = np.array([c["returned"] for c in calls])
    sizes = np.array([len(c["spans"]) for c in calls])
    times = np.concatenate([called, back])
    steps = np.concatenate([sizes, -sizes])
    order = np.lexsort((steps, times))  # at equal times, returns first
    held_rows = np.cumsum(steps[order])
    fed = np.flatnonzero(held_rows >= min(slots, in_flight, admit.size))
    start = max(times[order][fed[0]], first) if fed.size else first
    end = min(admit.max(), first + measure_s)
    window = max(end - start, 1e-9)
    slot_time = np.clip(np.minimum(release, end) - np.maximum(admit, start), 0, None).sum()
    # Rows finished by the engine but not yet returned, over time (up to the window end): peak.
    t2 = np.concatenate([release, returned])
    s2 = np.concatenate([np.ones_like(release), -np.ones_like(returned)])
    o2 = np.lexsort((s2, t2))
    held = int(np.cumsum(s2[o2])[t2[o2] <= end].max(initial=0))
    in_window = (admit >= start) & (admit < end)
    # Rows the engine held (queued, decoding or finished-but-not-returned), time-averaged.
    held_time = sum(len(c["spans"]) * max(0.0, min(c["returned"], end) - max(c["called"], start))
                    for c in calls)
    return {"rows": int(admit.size), "ramp_s": round(float(start - first), 2),
            "window_s": round(float(window), 1), "util": float(slot_time / (slots * window)),
            "rows_per_s": float(in_window.sum() / window), "avg_in_flight": float(held_time / window),
            "first_return_s": round(float(min(c["returned"] for c in calls) - first), 1),
            "held_peak": held, "calls": len(calls)}


def parse_setting(text: str, rows: int) -> tuple[int, int, str]:
    if text == "naive":
        return rows, 1, "naive (all rows x 1)"
    b, c = (int(x) for x in text.lower().split("x"))
    return b, c, f"{b} x {c}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=64, help="N: the engine's sequence slots (max_num_seqs)")
    parser.add_argument("--token-ms", type=float, default=1.0, help="decode time per token and slot")
    parser.add_argument("--measure-s", type=float, default=16.0,
                        help="measure this long after the first admission, then finish the rest at once")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--settings", nargs="+",
                        default=["64x1", "16x6", "4x24", "16x16", "16x64", "naive"],
                        help="BxC (batch_size x max_concurrent_batches) or naive")
    args = parser.parse_args()

    import ray

    from eagle_data.config import load_config
    from eagle_data.model_files import load_tokenizer, special_tokens
    from eagle_data.job.phases.run import run

    logging.basicConfig(level=logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="engine_feeding-"))
    try:
        tok = qwen3_dir(tmp)
        write_chat_rows(tmp / "rows.jsonl", args.rows, words=(20, 300))
        special = special_tokens(load_tokenizer(str(tok)), "<think>", "</think>")
        base = [f"source.dataset={tmp / 'rows.jsonl'}", f"model.path={tok}", "engine.backend=transformers",
                "engine.max_model_len=16384", f"sampling.max_tokens={MAX_TOKENS}",
                "output.rows_per_shard=200", "output.log_every_s=3600"]
        own_ray(num_cpus=2)
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        t0 = time.perf_counter()
        prompts = run(load_config(None, base + [f"output.path={tmp / 'base'}"]), phase="prompts")["prompts"]
        print(f"prompts phase: {prompts['prompts']} prompts ({prompts['prompt_tokens'] / prompts['prompts']:.0f} "
              f"tokens mean) in {time.perf_counter() - t0:.1f} s; engine: N={args.slots} slots, "
              f"{args.token_ms} ms/token, lengths mean 1300 / cap {MAX_TOKENS}; measuring {args.measure_s} s per setting",
              flush=True)

        results = []
        for text in args.settings:
            b, c, label = parse_setting(text, prompts["prompts"])
            out = tmp / f"out-{text}"
            shutil.copytree(tmp / "base", out)
            events = tmp / f"events-{text}.jsonl"
            cfg = load_config(None, base + [f"output.path={out}", f"engine.batch_size={b}",
                                            f"engine.max_concurrent_batches={c}"])
            stage = sim_stage_factory(args.slots, args.token_ms / 1000, args.measure_s, str(events), special)
            start = time.perf_counter()
            counts = run(cfg, phase="generate", engine=stage)["generate"]
            wall = time.perf_counter() - start
            calls = [json.loads(line) for line in events.read_text().splitlines()]
            r = analyse(calls, args.slots, args.measure_s, b * c)
            r.update(setting=label, b=b, c=c, wall_s=round(wall, 1), ok=counts["ok"],
                     in_flight=b * c)
            results.append(r)
            print(json.dumps(r), flush=True)
            shutil.rmtree(out)
        ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    naive = next((r for r in results if r["setting"].startswith("naive")), None)
    print(f"\nN = {args.slots} slots, {args.token_ms} ms/token; utilisation in the steady-state window "
          f"(engine first holds min(N, B x C) rows -> last admission or first admission +{args.measure_s:g} s)")
    print("\n| B x C | rows in flight | / N | rows held (avg) | utilisation | vs naive | rows/s | ramp s | window s | "
          "first return s | held peak | ok |\n" + "|---" * 12 + "|")
    for r in results:
        ratio = f"{r['util'] / naive['util']:.2f}x" if naive else "-"
        in_flight = r["in_flight"] if not r["setting"].startswith("naive") else r["b"]
        print(f"| {r['setting']} | {in_flight} | {in_flight / args.slots:.1f} | {r['avg_in_flight']:.0f} | "
              f"{100 * r['util']:.1f}% | {ratio} | {r['rows_per_s']:.1f} | "
              f"{r['ramp_s']:.1f} | {r['window_s']:.1f} | {r['first_return_s']:.1f} | {r['held_peak']} | {r['ok']} |")


if __name__ == "__main__":
    main()
