"""The driver's per-row structures of the prompts phase stay compact: the duplicate check
holds 10 bytes per dataset row, the sample's threshold at most 2n scores of 8 bytes.
(No Ray: the structures are fed the blocks the driver would receive.)"""

from __future__ import annotations

import gc
import hashlib
import random
import tracemalloc

import numpy as np
import pyarrow as pa

from eagle_data.job.phases.prompts import SeenPrompts, split_duplicates
from eagle_data.job.stages.sample import nth_smallest


def prompt_id(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()[:20]


def stage_batches(ids: list[str], answers: int, size: int) -> list[pa.Table]:
    """The prompts stage's output for these dataset rows: `answers` conversations per row,
    answer 0 first; every 97th row unusable (a reason, no prompt_id)."""
    rows = []
    for n, pid in enumerate(ids):
        if n % 97 == 0:
            rows.append({"prompt_id": "", "sample_id": pid, "answer": 0, "reason": "bad_json", "detail": "x"})
            continue
        rows += [{"prompt_id": pid, "sample_id": f"{pid}.{a}", "answer": a, "reason": "", "detail": ""}
                 for a in range(answers)]
    schema = pa.schema([("prompt_id", pa.string()), ("sample_id", pa.string()), ("answer", pa.int32()),
                        ("reason", pa.string()), ("detail", pa.string())])
    batches, start = [], 0
    while start < len(rows):  # a batch ends between dataset rows, as the stage's blocks do
        end = min(start + size, len(rows))
        while end < len(rows) and rows[end]["answer"] != 0:
            end += 1
        batches.append(pa.Table.from_pylist(rows[start:end], schema=schema))
        start = end
    return batches


def test_duplicate_check_finds_every_later_copy_and_holds_10_bytes_a_row():
    unique = [prompt_id(i) for i in range(60_000)]
    rng = random.Random(0)
    ids = unique + rng.sample(unique, 3_000)  # later copies, some in the same batch as the first
    rng.shuffle(ids)
    usable = [pid for n, pid in enumerate(ids) if n % 97]
    expected_duplicates = len(usable) - len(set(usable))
    batches = stage_batches(ids, answers=2, size=256)

    gc.collect()
    tracemalloc.start()
    try:
        seen = SeenPrompts()
        before = tracemalloc.get_traced_memory()[0]
        good_rows = duplicates = 0
        for batch in batches:
            good, bad = split_duplicates(batch, seen)
            good_rows += good.num_rows
            duplicates += bad.column("reason").to_pylist().count("duplicate")
            del good, bad
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
        # The form it replaced, for scale: a set of the prompt_id strings (as to_pylist makes them).
        strings = set()
        before_set = tracemalloc.get_traced_memory()[0]
        for batch in batches:
            strings.update(batch.column("prompt_id").to_pylist())
        set_bytes = tracemalloc.get_traced_memory()[0] - before_set
    finally:
        tracemalloc.stop()

    assert duplicates == expected_duplicates > 2_000
    assert good_rows == 2 * len(set(usable))  # both conversations of each first copy
    assert len(seen) == len(set(usable))
    per_row = retained / len(seen)
    assert per_row <= 16, f"the duplicate check holds {per_row:.1f} bytes per dataset row"
    assert set_bytes > 5 * retained, (set_bytes, retained)


def test_duplicate_check_keeps_the_first_copy_in_stream_order():
    a, b = prompt_id(1), prompt_id(2)
    seen = SeenPrompts()
    assert seen.add([a, b, a]).tolist() == [True, True, False]
    assert seen.add([b, prompt_id(3), prompt_id(3)]).tolist() == [False, True, False]
    assert seen.add([]).tolist() == []
    assert len(seen) == 3


def test_sample_threshold_is_the_nth_smallest_and_holds_at_most_2n_scores():
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 2**64, size=int(rng.integers(1, 3_000)), dtype=np.uint64) for _ in range(400)]
    blocks[7][:50] = blocks[3][:50]  # equal scores (identical rows) count each
    every = np.sort(np.concatenate(blocks))
    for n in (1, 999, 20_000, every.size):
        assert nth_smallest(iter(blocks), n) == int(every[n - 1])
    assert nth_smallest(iter(blocks), every.size + 1) is None

    n = 100_000
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        nth_smallest(iter(blocks), n)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    largest_block = max(b.nbytes for b in blocks)
    assert peak <= 16 * n + 2 * largest_block + 4096, f"{peak / n:.1f} bytes per sample row"


def test_report_by_variant_holds_no_python_object_per_prompts_row():
    from eagle_data.storage.report import by_variant

    n = 100_000
    prompts = pa.table({"sample_id": [prompt_id(i) for i in range(n)],
                        "variant": pa.array(["default", "cold"] * (n // 2)).dictionary_encode().cast(pa.string())})
    data = pa.table({c: pa.array([], t) for c, t in [("variant", pa.string()), ("finish_reason", pa.string()),
                                                     ("num_prompt_tokens", pa.int32()),
                                                     ("num_reasoning_tokens", pa.int32()),
                                                     ("num_response_tokens", pa.int32())]})
    failed = pa.table({"conversation_id_last": [prompt_id(3), prompt_id(4), "not-a-prompt"]})
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        found = by_variant(prompts, data, failed)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert {name: v["failed"] for name, v in found.items()} == {"default": 1, "cold": 1}
    assert {name: v["conversations"] for name, v in found.items()} == {"default": n // 2, "cold": n // 2}
    assert peak / n < 20, f"{peak / n:.0f} bytes per prompts/ row"
