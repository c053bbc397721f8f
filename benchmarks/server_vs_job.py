"""Does the job generate at least as fast as the peers' way (`vllm serve` + an OpenAI client
at concurrency C), keeping the engine's exact tokens and losing no row, and how close is it to
bare vLLM? Bare `vllm.LLM.generate`, the job's generate phase and the server, in one run on the
same prompts, sampling and engine kwargs; vLLM's CPU build, one engine.

    .venv/bin/python benchmarks/server_vs_job.py [--rows 128] [--max-tokens 256] [--mean 48]
        [--slots 64] [--concurrency 4 16 64] [--timeout-s 600] [--repeats 3]
        [--skip bare|job|server ...] [--engine-cores C ...] [--smoke]

Workload: a "babbling" Qwen3 (eagle_data/tiny_models.py, head_dim 64, real Qwen3 tokenizer)
with p(eos) = 1/--mean: geometric, long-tailed lengths capped at --max-tokens, on synthetic
chat rows that the prompts phase tokenizes once. Every path asks for temperature 1, top_p 1,
the job's per-row seed and stop ids, so every path that keeps the engine's tokens stores the
same ones; same engine kwargs everywhere (bf16, enforce_eager, max_num_seqs = --slots,
max_model_len 1024, a 0.5 GiB KV cache, max_num_batched_tokens 8192: vLLM's CPU default
differs between entry points, and a prefill split over two steps crashes a seeded request on
the CPU build, "CPU Generator does not use offset").

Paths, run --repeats times interleaved (bare, job, server; ...) so that a slow spell of the
machine hits each; the tables give the median and the range:
- bare: `LLM.generate` on the tokenized prompts (child process); seconds = the call.
- job: `run(cfg, phase="generate")` with the project's feeding rule (batch 4, feed_factor(4) x
  slots rows in flight); seconds = first request queued in the engine to its last token
  (vLLM's per-request metrics from Ray's stage). Ray, the pipeline start and the load apart.
- server: `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs), started
  once per repeat (start to /health apart); `openai.AsyncOpenAI` chat.completions on the
  rows' messages, at most C in flight, --timeout-s (the client's default, 600 s) and its
  default retries; seconds = the setting's wall time. A row is lost when its request still
  fails after the retries.

Exactness, per row against the reference (bare vLLM; the job with `--skip bare`): the job's
data/ ids and the server's `return_token_ids`; the server's prompt ids against the job's.

Where the time goes (second table): the engine's idle time and occupancy inside its window
(vLLM's per-request metrics; not over HTTP, so not for the server), and the CPU seconds of
each kind of process inside the window (the server: the setting's wall time; _cpu.py, every
0.5 s), also per 1,000 generated tokens. Ray stays up, idle, while the server runs: its CPU
shows in the server's column. The job's driver steps down to Ray's workers' niceness
(eagle_data/job/driver_priority.py); this process goes back to its own after each run().

`--engine-cores 0` (with --skip bare): vLLM's engine processes on core 0, every other
process of the tree (the job's driver, Ray, the replica actor; the server's API process and
client) on the others, re-applied at every sample: the engine on cores of its own, as on a
GPU node whose spare cores hold everything else. With RAY_ADDRESS set the job runs on that
Ray instance, whose workers are not this process's descendants: its CPU figures miss them.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

from _cpu import FRONT, KINDS, SAMPLER, CpuSampler, total  # noqa: E402
from _workload import REPO, metrics_recorder, one_engine_thread, qwen3_dir, start_ray, write_chat_rows  # noqa: E402

WORDS = [" the", " cat", " sat", " on", " mat", " and", " dog", " ran", "."]
KV_CACHE_BYTES = 2**29  # = engine.cpu_kv_cache_gib 0.5, the job's setting
MAX_MODEL_LEN = 1024
BARE, JOB = "bare vLLM (LLM.generate)", "job, default feeding"
NICENESS = os.getpriority(os.PRIO_PROCESS, 0)  # this process's at its start


def engine_kwargs(slots: int) -> dict:
    """The pass-through every engine gets (the job's max_model_len is its typed key)."""
    return {"dtype": "bfloat16", "enforce_eager": True, "max_num_seqs": slots, "max_num_batched_tokens": 8192}


def occupancy(spans: list[tuple[float, float, float]], slots: int) -> dict:
    """The engine's window (first queued to last token), its idle time (no request between
    its scheduled and last token) and mean running requests / slots, from (queued,
    scheduled, last token) per request."""
    start, end = min(s[0] for s in spans), max(s[2] for s in spans)
    events = sorted([(s[1], 1) for s in spans] + [(s[2], -1) for s in spans])
    running, at, idle, area = 0, start, 0.0, 0.0
    for t, step in events:
        idle += (t - at) if running == 0 else 0.0
        area += running * (t - at)
        running, at = running + step, t
    window = max(end - start, 1e-9)
    return {"start": start, "end": end, "window_s": window, "idle_s": idle, "occupancy": area / (window * slots)}


def read_prompts(out: Path) -> list[dict]:
    import pyarrow.dataset as pads

    return pads.dataset(sorted(Path(out, "prompts").glob("*.parquet"))).to_table(
        columns=["sample_id", "messages", "tokenized_prompt"]).to_pylist()


def bare_vllm(spec_path: str, result_path: str) -> None:
    """The child process: vllm.LLM on the prompts of the base OUT (its engine process is
    spawned, so this runs under the __main__ guard)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_data.job.stages.requests import row_seed

    spec = json.loads(Path(spec_path).read_text())
    prompts = read_prompts(Path(spec["out"]))
    t0 = time.perf_counter()
    # Stats on, as in Ray's stage (they give the per-request metrics the breakdown uses).
    llm = LLM(model=spec["model"], kv_cache_memory_bytes=KV_CACHE_BYTES, disable_log_stats=False,
              **spec["engine_kwargs"])
    load = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=spec["max_tokens"], temperature=1.0, top_p=1.0, seed=row_seed(0, p["sample_id"]),
                             stop_token_ids=spec["stop_ids"], detokenize=False) for p in prompts]
    with CpuSampler(front=FRONT) as cpu:
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p["tokenized_prompt"])) for p in prompts], params,
                            use_tqdm=False)
        engine_s = time.perf_counter() - t0
    spans = [(o.metrics.queued_ts, o.metrics.scheduled_ts, o.metrics.last_token_ts) for o in outs if o.metrics]
    Path(result_path).write_text(json.dumps({
        "load_s": load, "engine_s": engine_s, "spans": spans, "samples": cpu.samples, "pid": cpu.pid,
        "ids": {p["sample_id"]: list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)}}))


def timed_engine(events: str):
    """The configured engine stage (Ray's vLLM stage), its request metrics recorded."""
    from eagle_data.job.stages.engines import apply_engine

    def stage(ds, cfg, pad_id):
        return apply_engine(ds, cfg, pad_id).map_batches(metrics_recorder(events), batch_format="pyarrow")

    return stage


def run_bare(tmp: Path, spec: Path, repeat: int, slots: int) -> dict:
    result = tmp / f"bare-{repeat}.json"
    subprocess.run([sys.executable, __file__, "--bare", str(spec), str(result)], check=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    bare = json.loads(result.read_text())
    cpu = CpuSampler()
    cpu.pid = bare["pid"]
    cpu.samples = [(t, {int(pid): tuple(v) for pid, v in snap.items()}, own) for t, snap, own in bare["samples"]]
    engine = occupancy(bare["spans"], slots) if bare["spans"] else None
    window = (engine["start"], engine["end"]) if engine else (cpu.samples[0][0], cpu.samples[-1][0])
    return {"ids": bare["ids"], "seconds": bare["engine_s"], "load_s": bare["load_s"], "engine": engine,
            "cpu": cpu.window(*window)}


def job_ids(out: Path) -> dict[str, list[int]]:
    """Each data/ row's generated ids (input_ids after the prompt)."""
    import pyarrow.dataset as pads

    rows = pads.dataset(sorted(Path(out, "data").glob("*.parquet"))).to_table(
        columns=["sample_id", "input_ids", "num_prompt_tokens"]).to_pylist()
    return {r["sample_id"]: r["input_ids"][r["num_prompt_tokens"]:] for r in rows}


def run_job(tmp: Path, base: list[str], repeat: int, slots: int) -> dict:
    from eagle_data.config import load_config
    from eagle_data.job.phases.run import run
    from eagle_data.job.stages.engines.vllm_backend import feed_factor

    b, c = 4, math.ceil(feed_factor(4) * slots / 4)
    out = tmp / f"out-{repeat}"
    shutil.copytree(tmp / "base", out)
    events = tmp / f"events-{repeat}.jsonl"
    cfg = load_config(None, base + [f"output.path={out}", f"engine.batch_size={b}",
                                    f"engine.max_concurrent_batches={c}"])
    started = time.time()
    with CpuSampler() as cpu:
        counts = run(cfg, phase="generate", engine=timed_engine(str(events)))["generate"]
    restore_niceness()
    calls = [json.loads(line) for line in events.read_text().splitlines()]
    engine = occupancy([tuple(s) for c_ in calls for s in c_["spans"]], slots)
    ids = job_ids(out)
    assert counts["ok"] == len(ids), counts
    shutil.rmtree(out)
    return {"feeding": f"{b}x{c}", "ids": ids, "seconds": engine["window_s"],
            "load_s": min(c_["arrival"] for c_ in calls) - started, "engine": engine,
            "cpu": cpu.window(engine["start"], engine["end"])}


def restore_niceness() -> None:
    """Each run() of the job lowers its driver's priority to Ray's workers'
    (eagle_data/job/driver_priority.py), and this process is the job's driver: back to the
    niceness it started with, so that every path starts its processes there. Raising a
    priority needs a privilege (root here); without it the paths after the first run()
    run at the job's niceness, every process of a path alike."""
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, NICENESS)
        except (PermissionError, ProcessLookupError):
            pass


def free_port() -> int:
    """A port the kernel picks at random among the free ones."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, kwargs: dict, log_path: Path) -> tuple[subprocess.Popen, str, float]:
    """`vllm serve` (its module) with the job's engine kwargs, in its own process group so
    that stop_server kills its engine process too; returns once /health answers (however long
    its start takes on a loaded machine), or raises if it exits first."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", kwargs["dtype"], "--enforce-eager",
           "--max-num-seqs", str(kwargs["max_num_seqs"]), "--max-num-batched-tokens",
           str(kwargs["max_num_batched_tokens"]), "--max-model-len", str(MAX_MODEL_LEN),
           "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--disable-uvicorn-access-log"]
    t0 = time.perf_counter()
    # A process group, not a session: Linux schedules each session as one group (autogroup),
    # so a session of its own would give the server an equal share of the CPU against this
    # process and everything else it started, whatever their niceness (the test suite runs
    # this smoke at niceness 19 beside the tests).
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, process_group=0,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url, time.perf_counter() - t0
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"vllm serve exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def drive(url: str, model: str, prompts: list[dict], concurrency: int, timeout: float, max_tokens: int,
                stop_ids: list[int]) -> dict:
    """The peers' client: one chat request per row, at most `concurrency` in flight, the
    OpenAI client's default retries."""
    import openai

    from eagle_data.job.stages.requests import row_seed

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=timeout)
    gate = asyncio.Semaphore(concurrency)

    async def one(p):
        messages = [{"role": m["role"], "content": m["content"]} for m in p["messages"]]
        async with gate:
            try:
                return p["sample_id"], await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=max_tokens, temperature=1.0, top_p=1.0,
                    seed=row_seed(0, p["sample_id"]),
                    extra_body={"stop_token_ids": stop_ids, "return_token_ids": True})
            except openai.APIError as e:  # timeouts (after the retries) and HTTP errors: the row is lost
                return p["sample_id"], e

    start = time.monotonic()
    results = await asyncio.gather(*(one(p) for p in prompts))
    end = time.monotonic()
    await client.close()
    return {"start": start, "end": end, "results": dict(results)}


def run_server(tmp: Path, model: Path, kwargs: dict, prompts: list[dict], concurrency: list[int], timeout: float,
               max_tokens: int, stop_ids: list[int], repeat: int) -> dict[int, dict]:
    """One server start and its sweep: {C: result}."""
    import openai

    proc, url, load_s = start_server(model, kwargs, tmp / f"server-{repeat}.log")
    results = {}
    try:
        for conc in concurrency:
            with CpuSampler() as cpu:
                got = asyncio.run(drive(url, str(model), prompts, conc, timeout, max_tokens, stop_ids))
            ok = {s: r for s, r in got["results"].items() if not isinstance(r, Exception)}
            lost = collections.Counter("timeout" if isinstance(r, openai.APITimeoutError) else "error"
                                       for r in got["results"].values() if isinstance(r, Exception))
            results[conc] = {
                "feeding": conc, "lost": lost, "responses": ok,
                "ids": {s: r.choices[0].token_ids for s, r in ok.items()}, "seconds": got["end"] - got["start"],
                "tokens": sum(r.usage.completion_tokens for r in ok.values()), "load_s": load_s, "engine": None,
                "cpu": cpu.window(got["start"], got["end"])}
            print(f"server C={conc}: {len(ok)} ok, lost {dict(lost) or 0}, {results[conc]['seconds']:.1f} s", flush=True)
    finally:
        stop_server(proc)
    return results


def exactness(run: dict, reference: dict, prompts: list[dict]) -> str:
    """Rows whose ids equal the reference's; for the server also the prompts whose ids differ
    from the job's tokenized_prompt."""
    text = f"ids {sum(ids == reference.get(s) for s, ids in run['ids'].items())}/{len(run['ids'])}"
    if "responses" in run:
        by_id = {p["sample_id"]: p for p in prompts}
        differ = sum(r.prompt_token_ids != list(by_id[s]["tokenized_prompt"]) for s, r in run["responses"].items())
        text += f"; prompt ids differ {differ}" if differ else ""
    return text


def median_range(values: list[float], fmt: str) -> str:
    text = format(statistics.median(values), fmt)
    return text if len(values) == 1 else f"{text} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def print_results(runs: dict[str, list[dict]], reference: str, rows: int) -> None:
    """A row per path: median (range) over repeats; the ratio is against the reference path's
    run of the same repeat; rows lost summed over the repeats."""
    print(f"\n| run | feeding / C | rows ok | rows lost | generated tokens | seconds | tokens/s | "
          f"vs {reference.split(' (')[0]} (same repeat) | exact rows | load s |\n" + "|---" * 10 + "|")
    for name, rs in runs.items():
        rates = [r["tokens"] / r["seconds"] for r in rs]
        ratios = [rate / (ref["tokens"] / ref["seconds"]) for rate, ref in zip(rates, runs[reference])]
        lost = collections.Counter()
        for r in rs:
            lost.update(r.get("lost") or {"": rows - len(r["ids"])})
        cells = [name, rs[0].get("feeding", "-"), median_range([len(r["ids"]) for r in rs], ".0f"),
                 ", ".join(f"{n} {k}".strip() for k, n in sorted(lost.items()) if n) or "0",
                 "/".join(map(str, sorted({r["tokens"] for r in rs}))), median_range([r["seconds"] for r in rs], ".1f"),
                 median_range(rates, ".0f"), median_range(ratios, ".3f"), " / ".join(sorted({r["exact"] for r in rs})),
                 median_range([r["load_s"] for r in rs], ".0f")]
        print("| " + " | ".join(map(str, cells)) + " |")


def print_breakdown(runs: dict[str, list[dict]]) -> None:
    """A column per path (median over repeats, range): the engine's idle time and occupancy
    (bare and the job), then CPU seconds by kind of process inside its window."""
    print("\n| inside the engine's window (the server: the setting's wall time) | " + " | ".join(runs) + " |\n|---|"
          + "---|" * len(runs))
    for label, key, fmt, scale in (("engine idle s", "idle_s", ".2f", 1), ("engine occupancy %", "occupancy", ".1f", 100)):
        print(f"| {label} | " + " | ".join(median_range([scale * r["engine"][key] for r in rs], fmt)
                                           if rs[0]["engine"] else "-" for rs in runs.values()) + " |")
    print("| window s | " + " | ".join(median_range([r["seconds"] for r in rs], ".1f") for rs in runs.values()) + " |")
    for kind in [k for k, _ in KINDS] + [SAMPLER]:
        print(f"| CPU s: {kind} | " + " | ".join(median_range([r["cpu"][kind] for r in rs if kind in r["cpu"]], ".2f")
                                                 if any(kind in r["cpu"] for r in rs) else "-"
                                                 for rs in runs.values()) + " |")
    print("| CPU s: all processes | " + " | ".join(median_range([total(r["cpu"]) for r in rs], ".2f")
                                                   for rs in runs.values()) + " |")
    # A server whose every row was lost made no tokens: no figure per token.
    print("| CPU s: all processes per 1,000 generated tokens | " + " | ".join(
        median_range(per, ".2f") if (per := [1000 * total(r["cpu"]) / r["tokens"] for r in rs if r["tokens"]]) else "-"
        for rs in runs.values()) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--mean", type=float, default=48, help="mean completion length before the cap (1/p(eos))")
    parser.add_argument("--slots", type=int, default=64, help="max_num_seqs (at least the top concurrency, as a "
                                                             "peer's server is sized for its client)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--timeout-s", type=float, default=600.0, help="the client's timeout (its default: 600 s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each path, interleaved; the median is reported")
    parser.add_argument("--skip", nargs="+", default=[], choices=["bare", "job", "server"],
                        help="paths to leave out (without bare, the job is the reference)")
    parser.add_argument("--engine-cores", type=int, nargs="+", help="vLLM's engine processes (model worker, engine "
                        "core) on these cores and every other process on the rest, from each path's start (the "
                        "server: its sweep) to its end: the machinery of a path, as on a GPU node's spare cores, "
                        "no longer shares a core with the engine")
    parser.add_argument("--smoke", action="store_true", help="6 rows, 16 tokens, every path, C = 2, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.max_tokens, args.mean, args.slots, args.concurrency, args.repeats = 6, 16, 8, 4, [2], 1
    if args.engine_cores and "bare" not in args.skip:
        raise SystemExit("--engine-cores: add --skip bare (bare's engine runs in a child process the sampler "
                         "does not pin)")
    CpuSampler.engine_cores = set(args.engine_cores or ()) or None
    if "bare" in args.skip and "job" in args.skip:
        raise SystemExit("--skip: keep bare or the job, the reference the others are compared with")

    import ray

    from eagle_data.config import load_config
    from eagle_data.job.phases.generate import target_tokens
    from eagle_data.job.phases.run import run
    from eagle_data.model_files import load_tokenizer
    from eagle_data.tiny_models import build_babbling_model

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        p_stop = 1 / args.mean
        probs = {**{w: (1 - p_stop) / len(WORDS) for w in WORDS}, "<|im_end|>": p_stop}
        model = build_babbling_model(qwen3_dir(tmp), tmp / "babble", ["<|im_end|>", "<|endoftext|>"], probs, head_dim=64)
        write_chat_rows(tmp / "rows.jsonl", args.rows, (5, 40))
        kwargs = engine_kwargs(args.slots)
        base = [f"source.dataset={tmp / 'rows.jsonl'}", f"model.path={model}", "engine.backend=vllm",
                "engine.device=cpu", f"engine.cpu_kv_cache_gib={KV_CACHE_BYTES / 2**30}",
                f"engine.engine_kwargs={json.dumps(kwargs)}", f"engine.max_model_len={MAX_MODEL_LEN}",
                f"sampling.max_tokens={args.max_tokens}", "sampling.temperature=1.0", "sampling.top_p=1.0",
                "sampling.seed=0", "output.rows_per_shard=64", "output.log_every_s=3600",
                f"engine.cpu_threads={one_engine_thread()}"]
        ray_used = start_ray(num_cpus=2)
        logging.getLogger("ray").setLevel(logging.WARNING)
        base_cfg = load_config(None, base + [f"output.path={tmp / 'base'}"])
        run(base_cfg, phase="prompts")
        restore_niceness()
        stop_ids = list(target_tokens(base_cfg, load_tokenizer(str(model))).eos_ids)  # what the job asks for
        prompts = read_prompts(tmp / "base")

        spec = tmp / "bare.json"
        spec.write_text(json.dumps({"out": str(tmp / "base"), "model": str(model),
                                    "engine_kwargs": {**kwargs, "max_model_len": MAX_MODEL_LEN},
                                    "max_tokens": args.max_tokens, "stop_ids": stop_ids}))
        runs: dict[str, list[dict]] = collections.defaultdict(list)
        reference = BARE if "bare" not in args.skip else JOB
        for repeat in range(args.repeats):
            done: dict[str, dict] = {}  # this repeat's runs
            if "bare" not in args.skip:
                done[BARE] = run_bare(tmp, spec, repeat, args.slots)
            if "job" not in args.skip:
                done[JOB] = run_job(tmp, base, repeat, args.slots)
            if "server" not in args.skip:
                for conc, result in run_server(tmp, model, kwargs, prompts, args.concurrency, args.timeout_s,
                                               args.max_tokens, stop_ids, repeat).items():
                    done[f"server C={conc}"] = result
            ref = done[reference]
            for name, result in done.items():
                result.setdefault("tokens", sum(map(len, result["ids"].values())))
                result["exact"] = (f"ids {len(ref['ids'])}/{len(ref['ids'])} (the reference)" if name == reference
                                   else exactness(result, ref["ids"], prompts))
                runs[name].append(result)
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
        ray.shutdown()

    lengths = sorted(map(len, runs[reference][0]["ids"].values()))
    print(f"workload: {len(prompts)} prompts, geometric lengths mean {args.mean:g} capped at {args.max_tokens} "
          f"(measured mean {sum(lengths) / len(lengths):.1f}, longest {lengths[-1]}), max_num_seqs {args.slots}; "
          f"{args.repeats} repeat(s), interleaved, median (range); reference: {reference}; client timeout "
          f"{args.timeout_s:g} s; engine threads: VLLM_CPU_OMP_THREADS_BIND={os.environ['VLLM_CPU_OMP_THREADS_BIND']}; "
          f"ray: {ray_used}")
    print("load s: bare = LLM(...); the job = Ray + pipeline start + model load; the server = start to /health")
    print_results(runs, reference, len(prompts))
    print_breakdown(runs)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare"]:  # run_bare's child process
        bare_vllm(*sys.argv[2:4])
    else:
        main()
