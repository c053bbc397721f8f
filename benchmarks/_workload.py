"""Shared workload for the benchmarks: the real Qwen3 tokenizer, a pool of real English
text as Qwen3 token ids, and the long-tailed completion-length distribution.

Completion lengths: lognormal (sigma 1.0 by default) clipped to [16, 8192], with mu solved
(closed form of the clipped mean, bisection) so that the clipped mean is 1,300 tokens. About
1% of rows hit the 8,192 cap; those are cut: no `</think>`, no eos (finish_reason `length`).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIN_TOKENS, MAX_TOKENS, MEAN_TOKENS, SIGMA = 16, 8192, 1300, 1.0

# The test suite's smoke runs (tests/smokes.py) start a script whose Ray starts are all
# own_ray's at the tests' niceness and name here the one to take once its Ray is up. Started
# under `nice -n 19`, Ray's raylet and gcs got so little of the cores the tests kept busy that
# the raylet missed Ray's fixed 30 s wait (CI, 2026-12-06), whatever the retries.
SMOKE_NICENESS = "EAGLE_DATA_SMOKE_NICENESS"


def start_ray(**local) -> str:
    """Ray for a benchmark: the running instance at RAY_ADDRESS when that is set (the figures
    then share it with whatever else runs there), else a local instance of its own, started
    with `local` (num_cpus, object_store_memory, ...). Returns which, for the output."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return f"attached to the running instance at {address} (RAY_ADDRESS)"
    own_ray(**local)
    return "a local instance of its own"


def own_ray(**local) -> None:
    """A local Ray instance of the benchmark's own, started with `local`: tried again where it
    misses Ray's fixed wait for its raylet, as a job's own start is. Then, where SMOKE_NICENESS
    names one, this process and its Ray instance step down to that niceness."""
    import ray

    from eagle_data.job.ray_internals import start_in_rays_time

    start_in_rays_time(lambda: ray.init(include_dashboard=False, log_to_driver=False, **local))
    if niceness := os.environ.get(SMOKE_NICENESS):
        step_down(int(niceness))


def step_down(niceness: int) -> None:
    """This process and every process below it (its Ray instance: raylet, gcs, agents, the
    workers started so far), every thread, to at least `niceness`; what they start later
    inherits it."""
    import psutil

    from eagle_data.job.driver_priority import lower_to

    for pid in [os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))]:
        try:
            lower_to(niceness, pid)
        except ProcessLookupError:  # ended meanwhile
            pass


def one_engine_thread() -> int:
    """vLLM's CPU engine on one thread on every path of a benchmark. Sets
    VLLM_CPU_OMP_THREADS_BIND (unless set already) to the first core this process may use, which
    a bare `vllm.LLM` and `vllm serve` started from here inherit, and returns what the job's
    engine.cpu_threads should be for the same (1; a Ray instance that did not inherit the
    variable needs it). The paths compare like with like (the job's default, all cores,
    against vLLM's own binding, one core on 2, would not), as they were measured before that
    default, and the tiny models here gain nothing from a second thread (docs/development.md,
    "vLLM on CPU: the settings")."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(min(os.sched_getaffinity(0))))
    return 1


def qwen3_dir(dest: Path) -> Path:
    from eagle_data.tiny_models import extract_tokenizer

    return extract_tokenizer("qwen-3", Path(dest) / "qwen3")


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for X ~ lognormal(mu, sigma)."""
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    partial = math.exp(mu + sigma**2 / 2) * (_phi(b - sigma) - _phi(a - sigma))
    return lo * _phi(a) + partial + hi * (1 - _phi(b))


@functools.lru_cache(maxsize=None)
def solve_mu(mean: float = MEAN_TOKENS, sigma: float = SIGMA, lo: float = MIN_TOKENS,
             hi: float = MAX_TOKENS) -> float:
    a, b = math.log(lo), math.log(hi)
    for _ in range(100):
        mid = (a + b) / 2
        a, b = (mid, b) if clipped_lognormal_mean(mid, sigma, lo, hi) < mean else (a, mid)
    return (a + b) / 2


def completion_lengths(rng: np.random.Generator, n: int, mean: float = MEAN_TOKENS,
                       sigma: float = SIGMA, max_tokens: int = MAX_TOKENS) -> np.ndarray:
    mu = solve_mu(mean, sigma, MIN_TOKENS, max_tokens)
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), MIN_TOKENS, max_tokens).astype(np.int64)


def length_of(sample_id: str, seed: int = 0, mean: float = MEAN_TOKENS, sigma: float = SIGMA,
              max_tokens: int = MAX_TOKENS) -> int:
    """One completion length, seeded by the sample (the same whatever batch it lands in)."""
    rng = np.random.default_rng([seed, int(sample_id[:12], 16)])
    return int(completion_lengths(rng, 1, mean, sigma, max_tokens)[0])


def english_text() -> str:
    """Real English prose: the docstrings of a fixed list of standard-library modules and
    their public members (same text on every machine with the same Python)."""
    import argparse, asyncio, collections, concurrent.futures, contextlib, csv, dataclasses  # noqa: E401
    import datetime, decimal, email, fractions, functools, http.client, io, itertools  # noqa: E401
    import json, logging, os, pathlib, pickle, random, re, shutil, socket, sqlite3  # noqa: E401
    import statistics, string, subprocess, tarfile, threading, typing, unittest  # noqa: E401
    import urllib.request, uuid, zipfile  # noqa: E401

    modules = [argparse, asyncio, collections, concurrent.futures, contextlib, csv, dataclasses,
               datetime, decimal, email, fractions, functools, http.client, io, itertools, json,
               logging, os, pathlib, pickle, random, re, shutil, socket, sqlite3, statistics,
               string, subprocess, tarfile, threading, typing, unittest, urllib.request, uuid,
               zipfile]
    docs = []
    for m in modules:
        docs.append(inspect.getdoc(m) or "")
        for name in sorted(dir(m)):
            if name.startswith("_"):
                continue
            doc = inspect.getdoc(getattr(m, name, None))
            if doc and len(doc) > 200:
                docs.append(doc)
    seen, unique = set(), []
    for d in docs:
        if d not in seen:
            seen.add(d)
            unique.append(d)
    return "\n\n".join(unique)


def text_pool_ids(tokenizer) -> np.ndarray:
    """The English text as Qwen3 token ids (no special tokens: the text has none)."""
    ids = tokenizer(english_text(), add_special_tokens=False)["input_ids"]
    specials = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    arr = np.asarray(ids, dtype=np.int64)
    return arr[~np.isin(arr, list(specials))]


def engine_output(batch, generated: list[np.ndarray]):
    """The columns Ray's vLLM stage emits for a batch of the job's requests, answered with
    `generated` (token ids, one array per row): what a stand-in engine in the job's place hands on."""
    import pyarrow as pa

    n, lengths = batch.num_rows, [len(g) for g in generated]
    prompt = batch.column("tokenized_prompt")
    carried = batch.drop_columns(["tokenized_prompt", "sampling_params"])
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return pa.table({
        **{name: carried.column(name) for name in carried.column_names},
        "prompt": pa.array([""] * n), "prompt_token_ids": prompt,
        "num_input_tokens": pa.array([len(p) for p in prompt.to_pylist()], pa.int64()),
        "generated_tokens": pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(generated), pa.int64())),
        "generated_text": pa.array([""] * n), "num_generated_tokens": pa.array(lengths, pa.int64()),
        "embeddings": pa.nulls(n), "metrics": pa.nulls(n), "logprobs": pa.nulls(n),
        "prompt_logprobs": pa.nulls(n), "__inference_error__": pa.array([""] * n),
    })


def metrics_recorder(path: str):
    """A step after Ray's vLLM stage (`ds.map_batches(metrics_recorder(path), batch_format="pyarrow")`):
    each batch's vLLM request metrics, one JSON line a batch: the first arrival (wall clock),
    (queued, scheduled, last token) per request (the engine core's clock), and the rows."""
    import json

    def record(batch):
        metrics = [m for m in batch.column("metrics").to_pylist() if m]
        if metrics:
            with open(path, "a") as f:
                f.write(json.dumps({"arrival": min(m["arrival_time"] for m in metrics), "rows": len(metrics), "spans": [
                    (m["queued_ts"], m["scheduled_ts"], m["last_token_ts"]) for m in metrics]}) + "\n")
        return batch

    return record


def write_chat_rows(path: Path, n: int, words: tuple[int, int], seed: int = 0) -> None:
    """Synthetic open-perfectblend rows: one user turn of real English text with a word
    count drawn from [words[0], words[1]), five sources in turn."""
    import json

    rng = np.random.default_rng(seed)
    pool = english_text().split()
    sources = ["math", "code", "chat", "writing", "science"]
    with open(path, "w") as f:
        for i in range(n):
            k = int(rng.integers(*words))
            start = int(rng.integers(0, len(pool) - k))
            text = f"Question {i}: " + " ".join(pool[start:start + k])
            f.write(json.dumps({"conversations": [{"from": "human", "value": text},
                                                  {"from": "gpt", "value": "ok"}],
                                "source": sources[i % 5]}) + "\n")
