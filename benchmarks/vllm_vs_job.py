"""The job against bare vLLM: generated tokens per second of engine time, through the whole
generate phase (requests, Ray's vLLM stage, postprocess, shard writers), vs
`vllm.LLM.generate` on the same tokenized prompts. vLLM's CPU build, one replica.

    .venv/bin/python benchmarks/vllm_vs_job.py [--rows 192] [--max-tokens 256] [--mean 48]
        [--slots 16] [--settings default] [--repeats 3] [--worker-niceness N] [--smoke]

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
batch's slowest row finishes. `naive` is no longer run by default: each setting costs a
model load and a full generate per repeat, and it answered its question (section 5 of
docs/performance.md: on CPU it was not slower); pass `--settings default naive` for it.

Each of bare vLLM and the settings runs --repeats times, interleaved (bare, job, bare, job,
...), so that a slow spell of the machine hits both sides; the table gives the median and
the range. A second table says where the job's time goes against bare's, per run:
- the engine's idle time inside its window (no request between scheduled and last token)
  and its mean occupancy (running requests / max_num_seqs), from vLLM's per-request
  metrics (`RequestStateStats`: queued_ts, scheduled_ts, last_token_ts, engine-core
  monotonic clock; bare: `RequestOutput.metrics`, the job: Ray's `metrics` column);
- CPU seconds each process used inside that window (psutil, sampled every 0.5 s over this
  process and its descendants, i.e. the local Ray session): the engine core, the process
  in front of it (bare: the `LLM` process; the job: the replica actor running Ray's
  stage), Ray Data's other workers (postprocess, the reads and requests), raylet, gcs, the
  other Ray processes, and the driver (less the sampler's own thread, given apart), with
  the driver's threads (bare: the LLM process's) that used 0.05 CPU s or more;
- each kind of process's niceness (Ray starts workers at `worker_niceness`, 15; the
  driver, raylet and gcs stay at the shell's, 0). `--worker-niceness 0` starts this run's
  local Ray with its workers at 0, as bare vLLM runs: what `RAY_worker_niceness=0 ray start`
  would do on a cluster.
The CPU figures are approximate: a worker's CPU goes to the task it ran at the sample, and
a process that ends inside the window (the job's engine after its last row) counts up to
its last sample.

With RAY_ADDRESS set (the test suite's smoke run) the job runs on that Ray instance, whose
workers are not this process's descendants: the job's CPU breakdown then misses them.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import argparse  # noqa: E402
import bisect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402

from _workload import REPO, qwen3_dir, start_ray, write_chat_rows  # noqa: E402

WORDS = [" the", " cat", " sat", " on", " mat", " and", " dog", " ran", "."]

# Process kinds, in the breakdown's order: (kind, strings one of which its command line contains).
KINDS = [("engine model worker (VLLM::Worker)", ("VLLM::Worker",)), ("engine core (VLLM::EngineCore)", ("EngineCore",)),
         ("engine front (replica actor / LLM process)", ("VLLMEngine",)), ("driver", ()),
         ("Ray's actors and agents", ("_StatsActor", "Coordinator", "ActorLocationTracker", "Agent")),
         ("Ray Data task workers (reads, requests, postprocess)", ("ray::",)), ("raylet", ("raylet/raylet",)),
         ("gcs", ("gcs_server",)), ("other processes", ("",))]


def engine_kwargs(args) -> dict:
    """The pass-through both engines get (the job's max_model_len is its typed key)."""
    return {"dtype": "bfloat16", "enforce_eager": True, "max_num_seqs": args.slots}


class CpuSampler:
    """CPU seconds and niceness of this process and its descendants, sampled every `every_s`
    on the monotonic clock vLLM's engine core stamps its metrics with. A worker's command
    line is its current Ray task, so a sample's CPU goes to the kind the process had then."""

    def __init__(self, front: str | None = None, every_s: float = 0.5):
        self.front, self.every_s = front, every_s  # front: the kind of this process itself
        self.pid = os.getpid()  # the sampled process (bare's samples are read by its parent)
        # (time, {pid: (kind, cpu s, nice)}, the sampler thread's own CPU s so far: the
        # driver's figure includes it)
        self.samples: list[tuple[float, dict, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-sampler")

    def kind(self, proc: psutil.Process) -> str:
        if proc.pid == os.getpid():
            return self.front or "driver"
        line = " ".join(proc.cmdline())
        return next(kind for kind, needles in KINDS if any(n in line for n in needles))

    def sample(self) -> None:
        me = psutil.Process()
        snap = {}
        for proc in [me, *me.children(recursive=True)]:
            try:
                with proc.oneshot():
                    cpu = proc.cpu_times()
                    snap[proc.pid] = (self.kind(proc), cpu.user + cpu.system, proc.nice())
            except psutil.Error:  # exited meanwhile
                pass
        snap.update(self.own_threads(me))
        self.samples.append((time.monotonic(), snap, time.thread_time()))

    def own_threads(self, me: psutil.Process) -> dict:
        """This process's threads as (-thread id: ("thread: NAME", cpu s, nice)), NAME the
        Python thread's name or the OS one (Ray's C++ threads), digits dropped."""
        names = {t.native_id: t.name for t in threading.enumerate()}
        threads = {}
        for t in me.threads():
            try:
                name = names.get(t.id) or Path(f"/proc/self/task/{t.id}/comm").read_text().strip()
                nice = os.getpriority(os.PRIO_PROCESS, t.id)
            except OSError:  # ended meanwhile
                continue
            name = name.split("-dataset_")[0].rstrip("0123456789_-")  # one row per kind of thread
            if name != self._thread.name:  # given as "sampler thread"
                threads[-t.id] = ("thread: " + name, t.user_time + t.system_time, nice)
        return threads

    def _run(self) -> None:
        while True:
            self.sample()  # here only: its thread_time() is this thread's
            if self._stop.wait(self.every_s):
                return self.sample()

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, start: float, end: float) -> dict:
        """{kind: [CPU s, {nice values}]} between the last sample at or before `start` and
        the first at or after `end` (a process started meanwhile counts from 0, one gone by
        then, like the job's engine after its last row, up to its last sample); the sampler's
        own CPU is taken out of the driver's and given as "sampler thread"."""
        times = [t for t, _, _ in self.samples]
        begin = max(bisect.bisect_right(times, start) - 1, 0)
        stop = min(bisect.bisect_left(times, end), len(times) - 1)
        _, first, own0 = self.samples[begin]
        last = {pid: value for _, snap, _ in self.samples[begin:stop + 1] for pid, value in snap.items()}
        own1 = self.samples[stop][2]
        kinds: dict = {"sampler thread": [own1 - own0, set()]}
        for pid, (kind, cpu, nice) in last.items():
            entry = kinds.setdefault(kind, [0.0, set()])
            entry[0] += cpu - (first[pid][1] if pid in first else 0.0) - (own1 - own0 if pid == self.pid else 0)
            entry[1].add(nice)
        return kinds


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


def spans_of(metrics) -> list[tuple[float, float, float]]:
    return [(m["queued_ts"], m["scheduled_ts"], m["last_token_ts"]) for m in metrics]


def bare_vllm(spec_path: str, result_path: str) -> None:
    """The child process: vllm.LLM on the prompts of the base OUT (its engine process is
    spawned, so this runs under the __main__ guard)."""
    import dataclasses

    import pyarrow.dataset as pads
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_data.job.stages.requests import row_seed

    spec = json.loads(Path(spec_path).read_text())
    prompts = pads.dataset(sorted(Path(spec["out"], "prompts").glob("*.parquet"))).to_table(
        columns=["sample_id", "tokenized_prompt"]).to_pylist()
    t0 = time.perf_counter()
    # Stats on, as in Ray's stage (they give the per-request metrics the breakdown uses).
    llm = LLM(model=spec["model"], kv_cache_memory_bytes=2**29, disable_log_stats=False, **spec["engine_kwargs"])
    load = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=spec["max_tokens"], temperature=1.0, top_p=1.0, seed=row_seed(0, p["sample_id"]),
                             stop_token_ids=spec["stop_ids"], detokenize=False) for p in prompts]
    with CpuSampler(front="engine front (replica actor / LLM process)") as cpu:
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p["tokenized_prompt"])) for p in prompts], params,
                            use_tqdm=False)
        engine_s = time.perf_counter() - t0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    spans = spans_of([dataclasses.asdict(o.metrics) for o in outs]) if all(o.metrics for o in outs) else []
    Path(result_path).write_text(json.dumps({"load_s": load, "engine_s": engine_s, "tokens": sum(lengths),
                                             "rows": len(outs), "max_len": max(lengths), "spans": spans,
                                             "samples": cpu.samples, "pid": cpu.pid}))


def timed_engine(events: str):
    """The configured engine stage (Ray's vLLM stage) + a step recording each request's
    vLLM metrics."""
    from eagle_data.job.stages.engines import apply_engine

    def record(batch, path):
        metrics = [m for m in batch.column("metrics").to_pylist() if m]
        with open(path, "a") as f:
            f.write(json.dumps({"spans": spans_of(metrics), "arrival": min(m["arrival_time"] for m in metrics),
                                "tokens": sum(batch.column("num_generated_tokens").to_pylist())}) + "\n")
        return batch

    def stage(ds, cfg, pad_id):
        return apply_engine(ds, cfg, pad_id).map_batches(record, batch_format="pyarrow", fn_kwargs={"path": events})

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
    return {"tokens": bare["tokens"], "engine_s": bare["engine_s"], "load_s": bare["load_s"],
            "max_len": bare["max_len"], "engine": engine, "cpu": cpu.window(*window)}


def run_job(tmp: Path, base: list[str], setting: str, repeat: int, slots: int, expected: int) -> dict:
    from eagle_data.config import load_config
    from eagle_data.job.phases.run import run

    b, c = (4, math.ceil((2 + 4 / 8) * slots / 4)) if setting == "default" else (slots, 1)
    out = tmp / f"out-{setting}-{repeat}"
    shutil.copytree(tmp / "base", out)
    events = tmp / f"events-{setting}-{repeat}.jsonl"
    cfg = load_config(None, base + [f"output.path={out}", f"engine.batch_size={b}",
                                    f"engine.max_concurrent_batches={c}"])
    started = time.time()
    with CpuSampler() as cpu:
        counts = run(cfg, phase="generate", engine=timed_engine(str(events)))["generate"]
    assert counts["ok"] == expected, counts
    calls = [json.loads(line) for line in events.read_text().splitlines()]
    engine = occupancy([tuple(s) for c_ in calls for s in c_["spans"]], slots)
    shutil.rmtree(out)
    return {"feeding": f"{b}x{c}", "tokens": sum(c_["tokens"] for c_ in calls), "engine_s": engine["window_s"],
            "load_s": min(c_["arrival"] for c_ in calls) - started, "engine": engine,
            "cpu": cpu.window(engine["start"], engine["end"])}


def median_range(values: list[float], fmt: str) -> str:
    text = format(statistics.median(values), fmt)
    return text if len(values) == 1 else f"{text} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def print_results(runs: dict[str, list[dict]]) -> None:
    bare = runs["bare vLLM (LLM.generate)"]
    print("\n| run | batch x concurrent | generated tokens | engine s | tokens/s | vs bare (same repeat) | load s |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        rates = [r["tokens"] / r["engine_s"] for r in rs]
        ratios = [rate / (b["tokens"] / b["engine_s"]) for rate, b in zip(rates, bare)]
        tokens = sorted({r["tokens"] for r in rs})
        print(f"| {name} | {rs[0].get('feeding', '-')} | {'/'.join(map(str, tokens))} | "
              f"{median_range([r['engine_s'] for r in rs], '.1f')} | {median_range(rates, '.0f')} | "
              f"{median_range(ratios, '.3f')} | {median_range([r['load_s'] for r in rs], '.0f')} |")
    if len({r["tokens"] for rs in runs.values() for r in rs}) > 1:
        print("note: the runs did not all generate the same number of tokens")


def print_breakdown(runs: dict[str, list[dict]]) -> None:
    """A column per run (median over repeats, range): the engine's idle time and occupancy,
    then CPU seconds by kind of process inside the engine's window [its niceness]."""
    runs = {name: rs for name, rs in runs.items() if rs[0]["engine"]}
    print("\n| inside the engine's window | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for label, key, fmt, scale in (("engine window s", "window_s", ".1f", 1), ("engine idle s", "idle_s", ".2f", 1),
                                   ("engine occupancy %", "occupancy", ".1f", 100)):
        print(f"| {label} | " + " | ".join(median_range([scale * r["engine"][key] for r in rs], fmt)
                                           for rs in runs.values()) + " |")
    # The driver's (and bare's LLM process's) threads that used 0.05 CPU s or more in a run.
    threads = sorted({k for rs in runs.values() for r in rs for k, v in r["cpu"].items()
                      if k.startswith("thread: ") and v[0] >= 0.05})
    for kind in [k for k, _ in KINDS] + threads + ["sampler thread", "all processes"]:
        cells = []
        for rs in runs.values():
            if kind == "all processes":
                present = [(sum(v[0] for k, v in r["cpu"].items() if k != "sampler thread" and not k.startswith("thread: ")),
                            set()) for r in rs]
            else:
                present = [r["cpu"][kind] for r in rs if kind in r["cpu"]]
            nice = ",".join(map(str, sorted(set().union(*(p[1] for p in present)))))
            cells.append(median_range([p[0] for p in present], ".2f") + (f" [nice {nice}]" if nice else "")
                         if present else "-")
        label = f"of which {kind} (driver / LLM process)" if kind.startswith("thread: ") else kind
        print(f"| CPU s: {label} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--mean", type=float, default=48, help="mean completion length before the cap (1/p(eos))")
    parser.add_argument("--slots", type=int, default=16, help="max_num_seqs")
    parser.add_argument("--settings", nargs="+", default=["default"], choices=["default", "naive"])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved; the median is reported")
    parser.add_argument("--worker-niceness", type=int, help="Ray's worker_niceness for this run's local Ray "
                        "(Ray's default: 15); the cluster-wide setting `RAY_worker_niceness` of `ray start`")
    parser.add_argument("--smoke", action="store_true", help="8 rows, 16 tokens, default feeding, one repeat")
    parser.add_argument("--bare", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        return bare_vllm(*args.bare)
    if args.smoke:
        args.rows, args.max_tokens, args.mean, args.slots, args.settings, args.repeats = 8, 16, 8, 4, ["default"], 1

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
        niceness = {} if args.worker_niceness is None else {"worker_niceness": args.worker_niceness}
        if niceness and os.environ.get("RAY_ADDRESS"):
            raise SystemExit("--worker-niceness starts a Ray instance of its own: unset RAY_ADDRESS")
        ray_used = start_ray(num_cpus=2, _system_config=niceness)
        logging.getLogger("ray").setLevel(logging.WARNING)
        base_cfg = load_config(None, base + [f"output.path={tmp / 'base'}"])
        prompts = run(base_cfg, phase="prompts")["prompts"]
        stop_ids = list(target_tokens(base_cfg, load_tokenizer(str(model))).eos_ids)  # what the job asks for

        spec = tmp / "bare.json"
        spec.write_text(json.dumps({"out": str(tmp / "base"), "model": str(model),
                                    "engine_kwargs": {**kwargs, "max_model_len": 1024},
                                    "max_tokens": args.max_tokens, "stop_ids": stop_ids}))
        runs: dict[str, list[dict]] = {"bare vLLM (LLM.generate)": []}
        for repeat in range(args.repeats):
            runs["bare vLLM (LLM.generate)"].append(run_bare(tmp, spec, repeat, args.slots))
            for setting in args.settings:
                runs.setdefault(f"job, {setting} feeding", []).append(
                    run_job(tmp, base, setting, repeat, args.slots, prompts["prompts"]))
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
        ray.shutdown()

    first = runs["bare vLLM (LLM.generate)"][0]
    print(f"workload: {prompts['prompts']} prompts, geometric lengths mean {args.mean:g} capped at "
          f"{args.max_tokens} (longest {first['max_len']}), max_num_seqs {args.slots}; {args.repeats} repeat(s), "
          f"median (range); driver nice {os.nice(0)}; ray: {ray_used}")
    print_results(runs)
    print_breakdown(runs)


if __name__ == "__main__":
    main()
