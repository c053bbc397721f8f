"""Is the hidden-states phase near bare vLLM's prefill speed (target: 0.85 of it), and what
stands between them? Prefill tokens per second (tokens = sum of len(input_ids)) of the phase
and of bare vLLM over the same data/ rows, the job's machinery alone (an engine that computes
nothing), CPU seconds by kind of process, and the bytes written per token against the
storage estimate. vLLM's CPU build, one replica.

    .venv/bin/python benchmarks/hidden_states_throughput.py [--rows 192] [--gen 256 1024]
        [--slots 16] [--feeding B C] [--dtype bfloat16|float32] [--smoke]

The OUT is the job's own: the prompts phase on synthetic English chat rows (real Qwen3
tokenizer), then the generate phase with a scripted engine (a seeded number of tokens a row,
uniform in --gen). The target is the tiny 8-layer Qwen3 of the vLLM tests (head_dim 64 = H,
random weights, layer ids [2, 4, 5, 8]). On those rows:

1. bare `vllm.LLM.generate` (child process) with the job's engine kwargs and the phase's
   (`hidden_states_engine_kwargs`: extract_hidden_states and the project's connector), one
   hidden_states_path a request, max_tokens 1, timed until every file is written (a shared
   flock on each `.lock`); the ratios are against this. A 64-token warm-up request first
   takes the engine's first-call costs, which the phase's cold engine pays inside its run:
   the "cold" row adds them back.
2. the phase (`run_hidden_states`, its scratch folder node-local), a step after Ray's stage
   recording vLLM's per-request metrics: engine = first request queued to last token; phase
   = first request's arrival to the phase returning (files, packing, publishing included);
   wall = the whole call; load = call start to first arrival. And how many requests the
   engine held through its window (an engine short of work, or short of CPU).
3. the floor: the same phase on a copy of the OUT with `instant_engine`, an actor per
   replica (same batch size and concurrency) that hands each row back at once with constant
   states of its shape through row dicts, as Ray's stage does, once the vLLM replicas have
   exited: the job's machinery alone, which no engine can beat on the same cores.
4. CPU seconds by kind of process inside each window (_cpu.py, every 0.1 s), each window's
   capacity (seconds x cores) and the job's machinery per row (all but vLLM's two processes).
5. bytes: hidden_states/*.safetensors against `layer_bytes` (the excess: the shards' headers).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import argparse  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from _cpu import ENGINE_KINDS, FRONT, KINDS, CpuSampler, total  # noqa: E402
from _workload import (REPO, engine_output, metrics_recorder, one_engine_thread, qwen3_dir, start_ray,  # noqa: E402
                       write_chat_rows)

VOCAB_TEXT = 151643  # Qwen3: ids below this are ordinary text tokens


def data_rows(out: str) -> list[dict]:
    """sample_id and input_ids of OUT/data, in a fixed order (the same on every side)."""
    import pyarrow.dataset as pads

    files = sorted(str(p) for p in Path(out, "data").glob("*.parquet"))
    rows = pads.dataset(files).to_table(columns=["sample_id", "input_ids"]).to_pylist()
    return sorted(rows, key=lambda r: r["sample_id"])


def scripted_engine(gen: tuple[int, int], special):
    """`engine(ds, cfg, pad_id) -> ds` for the generate phase: each row answers with a seeded
    number of random text tokens in [gen[0], gen[1]], columns as Ray's vLLM stage emits."""

    def answer(batch: pa.Table) -> pa.Table:
        ids = []
        for s in batch.column("sample_id").to_pylist():
            rng = np.random.default_rng(int(s[:12], 16))
            n = int(rng.integers(gen[0], gen[1] + 1))
            t = rng.integers(0, VOCAB_TEXT, n)
            t[0], t[n // 3], t[-1] = special.reasoning_start_id, special.reasoning_end_id, special.eos_ids[0]
            ids.append(t)
        return engine_output(batch, ids)

    def stage(ds, cfg, pad_id):
        return ds.map_batches(answer, batch_format="pyarrow")  # each block is one engine batch

    return stage


def timed_hidden_states_engine(events: str):
    """The phase's vLLM stage (vllm_hidden_states.vllm_hidden_states_stage's three steps) with
    a step after Ray's stage that records each batch's vLLM request metrics."""

    def stage(ds, cfg, layer_ids, dtype, scratch_dir):
        from eagle_data.job.stages.engines.vllm_backend import build_vllm_processor, wait_for_replica_resources
        from eagle_data.job.stages.engines.vllm_hidden_states import (
            ExtractRequests,
            HiddenStatesRows,
            hidden_states_engine_kwargs,
        )

        wait_for_replica_resources(cfg)
        ds = ds.map_batches(ExtractRequests(), batch_format="pyarrow")
        ds = build_vllm_processor(cfg, hidden_states_engine_kwargs(layer_ids, dtype, scratch_dir))(ds)
        ds = ds.map_batches(metrics_recorder(events), batch_format="pyarrow")
        return ds.map_batches(HiddenStatesRows(), batch_format="pyarrow")

    return stage


def instant_engine(events: str, hidden_size: int):
    """A stand-in for Ray's vLLM stage that computes nothing: an actor (one per replica, the
    same batch size and concurrency) that turns each batch into row dicts, as Ray's stage
    does, and hands each row back at once with constant states of its exact shape (bytes
    0x3f: finite and not zero, so they pass the packer's checks). The rest of the phase
    (reads, requests, packing, publishing) is the job's own, so the phase with it is the
    job's machinery alone: a floor under the phase's time that no engine can go below on the
    same cores."""
    from eagle_data.job.stages.engines.vllm_hidden_states import HiddenStatesRows

    class InstantStates:
        def __init__(self, layers: int, itemsize: int):
            self.row_bytes = layers * hidden_size * itemsize
            self.layers = layers

        async def __call__(self, batch: pa.Table):
            with open(events, "a") as f:
                f.write(json.dumps({"arrival": time.time(), "rows": batch.num_rows}) + "\n")
            rows = batch.to_pylist()
            for row in rows:
                n = len(row["input_ids"])
                row.update({"hidden_states": b"\x3f" * (n * self.row_bytes),
                            "hidden_states_shape": [n, self.layers, hidden_size],
                            "hidden_token_ids": list(row["input_ids"]), "__inference_error__": ""})
            yield {name: [row[name] for row in rows] for name in rows[0]}

    def stage(ds, cfg, layer_ids, dtype, scratch_dir):
        import ray

        ds = ds.map_batches(InstantStates, fn_constructor_args=(len(layer_ids), {"float32": 4}.get(dtype, 2)),
                            batch_size=cfg.engine.batch_size, batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=cfg.engine.replicas),
                            max_concurrency=cfg.engine.max_concurrent_batches)
        return ds.map_batches(HiddenStatesRows(), batch_format="pyarrow")

    return stage


def queue_depth(spans: list[tuple[float, float, float]]) -> dict:
    """From vLLM's per-request (queued, scheduled, last token) times: how many requests the
    engine held (in its queue or running), sampled every 10 ms of its window, and the share
    of the window with none waiting to be scheduled (the engine short of work)."""
    start, end = min(q for q, _, _ in spans), max(t for _, _, t in spans)
    held, none_waiting = [], 0
    steps = max(int((end - start) / 0.01), 1)
    for k in range(steps):
        t = start + k * 0.01
        held.append(sum(q <= t < last for q, _, last in spans))
        none_waiting += not any(q <= t < s for q, s, _ in spans)
    return {"held_mean": sum(held) / len(held), "held_min": min(held), "none_waiting": none_waiting / steps}


def engines_gone(timeout_s: float = 120) -> None:
    """Wait until no vLLM replica of this benchmark's Ray instance is left (an actor that
    Ray Data released exits in the background, its vLLM processes with it)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = []
        for proc in psutil.Process().children(recursive=True):
            try:
                lines.append(" ".join(proc.cmdline()))
            except psutil.Error:
                pass
        if not any("VLLMEngine" in line or "spawn_main" in line for line in lines):
            return
        time.sleep(0.5)
    print(f"warning: vLLM processes still running after {timeout_s:g} s: the floor's CPU figures include them")


def bare_vllm(spec_path: str, result_path: str) -> None:
    """The child process: vllm.LLM on data/'s token ids, one file per request (its engine
    process is spawned, so this runs under the __main__ guard)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    rows = data_rows(spec["out"])
    scratch = Path(spec["scratch"])
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **spec["engine_kwargs"])
    load = time.perf_counter() - t0
    paths = [str(scratch / f"{r['sample_id']}.safetensors") for r in rows]
    params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                             extra_args={"kv_transfer_params": {"hidden_states_path": p}}) for p in paths]
    prompts = [TokensPrompt(prompt_token_ids=list(r["input_ids"])) for r in rows]
    warm = str(scratch / "warm-up.safetensors")  # tokens no row starts with: no prefix-cache hit later
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=list(range(1000, 1064)))],
                 [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                 extra_args={"kv_transfer_params": {"hidden_states_path": warm}})], use_tqdm=False)
    with open(warm + ".lock") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
    warm_s = time.perf_counter() - t0
    with CpuSampler(front=FRONT, every_s=0.1) as cpu:
        t0 = time.perf_counter()
        window = [time.monotonic()]
        llm.generate(prompts, params, use_tqdm=False)
        generate_s = time.perf_counter() - t0
        for p in paths:  # until every file is whole: the connector holds <path>.lock exclusively while writing
            with open(p + ".lock") as f:
                fcntl.flock(f, fcntl.LOCK_SH)
        written_s = time.perf_counter() - t0
        window.append(time.monotonic())
    missing = [p for p in paths if not os.path.exists(p)]
    from safetensors import safe_open

    with safe_open(paths[0], "pt") as f:
        shape = list(f.get_slice("hidden_states").get_shape())
    Path(result_path).write_text(json.dumps({
        "load_s": load, "warm_s": warm_s, "generate_s": generate_s, "written_s": written_s, "rows": len(rows),
        "tokens": sum(len(r["input_ids"]) for r in rows), "missing": len(missing), "first_shape": shape,
        "bytes": sum(os.path.getsize(p) for p in paths if os.path.exists(p)), "cpu": cpu.window(*window)}))
    os.remove(warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=192)
    parser.add_argument("--gen", type=int, nargs=2, default=[256, 1024], metavar=("MIN", "MAX"),
                        help="generated tokens per data/ row, uniform in [MIN, MAX] (the prompt adds ~20-70)")
    parser.add_argument("--slots", type=int, default=16, help="max_num_seqs")
    parser.add_argument("--feeding", type=int, nargs=2, metavar=("B", "C"),
                        help="engine.batch_size and max_concurrent_batches (default: the project's rule, 4 x "
                             "ceil(2.5 x slots / 4))")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--smoke", action="store_true", help="8 rows of 16-48 generated tokens")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.gen, args.slots = 8, [16, 48], 4

    import ray

    from eagle_data.config import load_config
    from eagle_data.job.phases.generate import target_tokens
    from eagle_data.feature_shape import layer_ids as phase_layer_ids
    from eagle_data.feature_shape import target_shape
    from eagle_data.job.phases.hidden_states import run_hidden_states
    from eagle_data.job.phases.run import run
    from eagle_data.job.stages.engines.vllm_backend import engine_kwargs as job_engine_kwargs
    from eagle_data.job.stages.engines.vllm_hidden_states import hidden_states_engine_kwargs
    from eagle_data.model_files import load_tokenizer
    from eagle_data.storage.folder import Output
    from eagle_data.storage.hidden_states import layer_bytes
    from eagle_data.tiny_models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_model(qwen3_dir(tmp), tmp / "deep-qwen3", head_dim=64, layers=8)
        write_chat_rows(tmp / "rows.jsonl", args.rows, (5, 40))
        max_len = 1 << math.ceil(math.log2(args.gen[1] + 256))
        kwargs = {"enforce_eager": True, "max_num_seqs": args.slots}
        b, c = args.feeding or (4, math.ceil((2 + 4 / 8) * args.slots / 4))  # default: the project's feeding rule
        out, local = tmp / "out", tmp / "node-local"  # OUT; the engine node's scratch folder
        cfg = load_config(None, [
            f"source.dataset={tmp / 'rows.jsonl'}", f"model.path={model}", f"output.path={out}",
            "engine.backend=vllm", "engine.device=cpu", "engine.cpu_kv_cache_gib=0.5",
            f"engine.engine_kwargs={json.dumps(kwargs)}", f"engine.max_model_len={max_len}",
            f"sampling.max_tokens={args.gen[1] + 1}", f"engine.batch_size={b}", f"engine.max_concurrent_batches={c}",
            f"hidden_states.dtype={args.dtype}", f"hidden_states.scratch_dir={local}", "output.log_every_s=3600",
            f"engine.cpu_threads={one_engine_thread()}"])
        ray_used = start_ray(num_cpus=os.cpu_count())
        logging.getLogger("ray").setLevel(logging.WARNING)
        run(cfg, phase="prompts")
        special = target_tokens(cfg, load_tokenizer(str(model)))
        run(cfg, phase="generate", engine=scripted_engine(tuple(args.gen), special))
        rows = data_rows(str(out))
        tokens = sum(len(r["input_ids"]) for r in rows)
        num_layers, hidden_size = target_shape(cfg)
        ids = phase_layer_ids(cfg, num_layers)
        print(f"workload: {len(rows)} data/ rows, {tokens} tokens (longest {max(len(r['input_ids']) for r in rows)}), "
              f"layer ids {ids} of {num_layers}, H {hidden_size}, {args.dtype}, max_num_seqs {args.slots}, "
              f"batch {b} x {c} concurrent, {os.cpu_count()} cores, vLLM's threads on core(s) "
              f"{os.environ['VLLM_CPU_OMP_THREADS_BIND']}; ray: {ray_used}", flush=True)

        # 1. bare vLLM first, while the parent's Ray workers are idle.
        spec = tmp / "bare.json"
        bare_kwargs = {**job_engine_kwargs(cfg), **hidden_states_engine_kwargs(ids, args.dtype, str(tmp / "bare"))}
        spec.write_text(json.dumps({"out": str(out), "model": str(model), "engine_kwargs": bare_kwargs,
                                    "scratch": str(tmp / "bare")}))
        subprocess.run([sys.executable, __file__, "--bare", str(spec), str(tmp / "bare-result.json")], check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
        bare = json.loads((tmp / "bare-result.json").read_text())
        assert bare["missing"] == 0 and bare["tokens"] == tokens, bare
        assert bare["first_shape"][1:] == [len(ids), hidden_size], bare
        shutil.rmtree(tmp / "bare")

        # 2. the phase on vLLM.
        events = tmp / "events.jsonl"
        floor_out = tmp / "out-floor"
        shutil.copytree(out, floor_out)  # before the phase: data/ without hidden states
        started = time.time()
        with CpuSampler(every_s=0.1) as cpu:
            counts = run_hidden_states(cfg, Output(str(out)), engine=timed_hidden_states_engine(str(events)))
        ended = time.time()
        assert counts["ok"] == len(rows) and counts["failed_rows"] == 0, counts
        calls = [json.loads(line) for line in events.read_text().splitlines()]
        assert sum(c_["rows"] for c_ in calls) == len(rows), calls
        spans = [span for c_ in calls for span in c_["spans"]]  # (queued, scheduled, last token) per request
        engine_s = max(last for _, _, last in spans) - min(queued for queued, _, _ in spans)
        first = min(c_["arrival"] for c_ in calls)
        waiting = queue_depth(spans)
        phase_s, wall_s, load_s = ended - first, ended - started, first - started
        to_monotonic = time.monotonic() - time.time()
        phase_cpu = cpu.window(first + to_monotonic, ended + to_monotonic)
        written = sum(p.stat().st_size for p in (out / "hidden_states").glob("*.safetensors"))
        estimate = layer_bytes(tokens, len(ids), hidden_size, args.dtype)

        # 3. the floor: the same phase with an engine that computes nothing, once the vLLM
        # replicas above have exited (their shutdown would run inside the floor's window).
        engines_gone()
        floor_events = tmp / "floor-events.jsonl"
        floor_cfg = cfg.model_copy(update={"output": cfg.output.model_copy(update={"path": str(floor_out)})})
        with CpuSampler(every_s=0.1) as cpu:
            floor_counts = run_hidden_states(floor_cfg, Output(str(floor_out)),
                                             engine=instant_engine(str(floor_events), hidden_size))
        floor_end = time.time()
        assert floor_counts["ok"] == len(rows) and floor_counts["failed_rows"] == 0, floor_counts
        floor_first = min(json.loads(line)["arrival"] for line in floor_events.read_text().splitlines())
        to_monotonic = time.monotonic() - time.time()
        floor = {"seconds": floor_end - floor_first,
                 "cpu": cpu.window(floor_first + to_monotonic, floor_end + to_monotonic)}
        ray.shutdown()

    bare_rate = tokens / bare["written_s"]
    table = [
        ("bare vLLM, generate + files written", bare["written_s"], bare["load_s"]),
        ("bare vLLM, generate call only", bare["generate_s"], bare["load_s"]),
        ("bare vLLM, cold: + its warm-up call (first-call costs)", bare["written_s"] + bare["warm_s"], bare["load_s"]),
        ("phase on vLLM, first request to phase done", phase_s, load_s),
        ("phase on vLLM, engine (first queued to last token)", engine_s, load_s),
        ("phase on vLLM, wall (incl. Ray pipeline start + load)", wall_s, 0.0),
        ("floor: the phase with an engine that computes nothing, first row to phase done", floor["seconds"], 0.0),
    ]
    print("\n| path | rows | tokens | seconds | prefill tok/s | vs bare vLLM | load s |")
    print("|---|---|---|---|---|---|---|")
    for name, seconds, load in table:
        rate = tokens / seconds
        print(f"| {name} | {len(rows)} | {tokens} | {seconds:.2f} | {rate:.0f} | {rate / bare_rate:.2f} | "
              f"{load:.1f} |")
    print(f"\nthe phase's engine held {waiting['held_mean']:.1f} requests on average (fewest {waiting['held_min']}, "
          f"max_num_seqs {args.slots}); none waiting to be scheduled in {100 * waiting['none_waiting']:.1f}% of its window")
    print_cpu({"bare vLLM": {"seconds": bare["written_s"], "cpu": bare["cpu"]},
               "phase on vLLM": {"seconds": phase_s, "cpu": phase_cpu}, "floor (no engine)": floor}, len(rows))
    per_token = len(ids) * hidden_size * (2 if args.dtype != "float32" else 4)
    print(f"\nbytes: the phase wrote {written} B in hidden_states/ = {written / tokens:.1f} B/token; estimate "
          f"(layer_bytes: {len(ids)} layers x H {hidden_size} x {per_token // (len(ids) * hidden_size)} B) "
          f"{estimate} B = {estimate / tokens:.1f} B/token; written/estimate {written / estimate:.4f}"
          f" (bare vLLM's per-request files: {bare['bytes'] / tokens:.1f} B/token)")


def print_cpu(runs: dict[str, dict], rows: int) -> None:
    """CPU seconds by kind of process inside each run's window (bare: the generate call until
    every file is written; the phase and the floor: first request to the phase returning),
    the cores' capacity in that window, and the job's machinery per row: every process but
    vLLM's two and the sampler."""
    print("\n| CPU s inside the window | " + " | ".join(runs) + " |\n|---|" + "---|" * len(runs))
    print("| window s (x cores = capacity) | " + " | ".join(
        f"{r['seconds']:.2f} (x {os.cpu_count()} = {r['seconds'] * os.cpu_count():.2f})" for r in runs.values()) + " |")
    for kind in [k for k, _ in KINDS]:
        print(f"| {kind} | " + " | ".join(f"{r['cpu'][kind]:.2f}" if kind in r["cpu"] else "-"
                                          for r in runs.values()) + " |")
    print("| all processes | " + " | ".join(f"{total(r['cpu']):.2f}" for r in runs.values()) + " |")
    print("| all but vLLM's two processes, per row (ms) | " + " | ".join(
        f"{total(r['cpu'], ENGINE_KINDS):.2f} ({1000 * total(r['cpu'], ENGINE_KINDS) / rows:.1f})"
        for r in runs.values()) + " |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare"]:  # the child process of step 1
        bare_vllm(*sys.argv[2:4])
    else:
        main()
