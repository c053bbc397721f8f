"""Picking the seeded sample of the dataset's rows: the baseline (the n rows with the
smallest seeded content hash) or the source-balanced one (`source.per_source`). Both are
independent of the file split, read order and block layout.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable
from fractions import Fraction

import numpy as np
import pyarrow as pa
import ray

from eagle_data.config import PerSourceConfig, SourceConfig
from eagle_data.job.stages.columns import Stage, columns

log = logging.getLogger("eagle_data")


def sample_scores(row_ids: list[str], seed: int) -> np.ndarray:
    """A seeded pseudo-random score per row that depends only on the row's content."""
    prefix = f"{seed}:".encode()
    return np.array(
        [int.from_bytes(hashlib.blake2b(prefix + r.encode(), digest_size=8).digest(), "big")
         for r in row_ids],
        dtype=np.uint64,
    )


def select_sample(ds: ray.data.Dataset, n: int | None, seed: int) -> ray.data.Dataset:
    """Keep the n rows with the smallest scores: the same rows whatever the read order or
    block layout. Identical rows share a score, so all copies are kept (and later skipped
    as duplicates); the selection can then exceed n by the number of such copies.

    Two passes over the source: the first keeps at most n scores per block and merges them
    on the driver (nth_smallest: at most 2n scores, 8 bytes each, not O(rows)); the second
    filters.
    """
    if n is None:
        return ds
    blocks = ds.map_batches(SmallestScores(seed, n), batch_format="pyarrow").iter_batches(
        batch_format="numpy", batch_size=None)
    threshold = nth_smallest((batch["score"] for batch in blocks), n)
    if threshold is None:
        return ds  # fewer rows than asked for: take them all
    return ds.map_batches(BelowThresholds(seed, {}, default=threshold), batch_format="pyarrow")


def nth_smallest(batches: Iterable[np.ndarray], n: int) -> int | None:
    """The n-th smallest of the scores of all batches (equal scores counted each), or None
    when there are fewer than n. Holds at most 2n of them in one uint64 array (16 bytes per
    sample row at most, not a heap of Python ints), and the array's pages are touched only
    as scores arrive. Each trim to the n smallest follows n new scores: O(rows) work."""
    kept = np.empty(2 * n, np.uint64)
    size = 0
    for scores in batches:
        if scores.size > n:
            scores = np.partition(scores, n - 1)[:n]
        if size + scores.size > kept.size:  # then size > n
            kept[:size].partition(n - 1)
            size = n
        kept[size:size + scores.size] = scores
        size += scores.size
    if size < n:
        return None
    kept[:size].partition(n - 1)
    return int(kept[n - 1])


def select_rows(ds: ray.data.Dataset, cfg: SourceConfig) -> tuple[ray.data.Dataset, dict | None]:
    """The rows the prompts phase uses: the baseline sample, or with `source.per_source` the
    source-balanced one, then also {source: {"available": rows, "quota": rows}}."""
    if cfg.per_source is None:
        return select_sample(ds, cfg.sample, cfg.seed), None
    return select_per_source(ds, cfg.sample, cfg.seed, cfg.per_source)


def source_quotas(available: dict[str, int], sample: int | None, max_rows: int | None = None,
                  weights: dict[str, float] | None = None) -> dict[str, int]:
    """Rows to take from each source, from the per-source row counts alone.

    capacity = min(rows, max_rows). With `sample` null every source gives its capacity.
    Otherwise `sample` is shared out in proportion to the weights (absent: equal; "*" = any
    source not listed; no weight = nothing), a source getting at most its capacity; what a
    full source cannot take goes to the others by their weights (water-filling). Shares are
    exact fractions made integers by largest remainder (ties: source name), so the total is
    `sample`, or every row of the weighted sources when they hold fewer.
    """
    capacity = {s: n if max_rows is None else min(n, max_rows) for s, n in available.items()}
    if sample is None:
        if weights is not None:
            raise ValueError("per-source weights share out a sample size; sample is None")
        return capacity
    weight = {s: Fraction(1) if weights is None else Fraction(weights.get(s, weights.get("*", 0)))
              for s in available}
    quota = dict.fromkeys(available, 0)
    active = sorted(s for s in available if weight[s] > 0 and capacity[s] > 0)
    remaining = sample
    while active:
        total = sum(weight[s] for s in active)
        full = [s for s in active if remaining * weight[s] / total >= capacity[s]]
        if not full:
            break
        for s in full:  # these shares are >= their capacity, so `remaining` stays >= 0
            quota[s] = capacity[s]
            remaining -= capacity[s]
        active = [s for s in active if s not in full]
    if active:
        total = sum(weight[s] for s in active)
        share = {s: remaining * weight[s] / total for s in active}
        for s in active:
            quota[s] = math.floor(share[s])
        left = remaining - sum(quota[s] for s in active)  # < len(active)
        by_remainder = sorted(active, key=lambda s: (quota[s] - share[s], s))
        for s in by_remainder[:left]:  # a share below capacity rounds up to at most capacity
            quota[s] += 1
    return quota


def select_per_source(ds: ray.data.Dataset, sample: int | None, seed: int,
                      per_source: PerSourceConfig) -> tuple[ray.data.Dataset, dict]:
    """Within each source, keep its quota of rows with the smallest scores (the baseline's
    score): independent of read order and block layout, and the rows kept at quota q are
    among those kept at q + 1. Identical rows share a score and are all kept, as in the
    baseline.

    Two passes: the first counts the rows of each source and keeps at most `bound` smallest
    scores per source and block (bound = min(sample, max_rows) >= any quota), merged on the
    driver (memory O(sources x bound), not O(rows)); the second filters each source at the
    score of its quota-th row.
    """
    bound = min(b for b in (sample, per_source.max_rows) if b is not None)

    available: dict[str, int] = {}
    smallest: dict[str, np.ndarray] = {}
    for batch in ds.map_batches(BlockScores(seed, bound), batch_format="pyarrow").iter_batches(
        batch_format="pyarrow", batch_size=None
    ):
        for source, rows, scores in zip(batch.column("source").to_pylist(), batch.column("rows").to_pylist(),
                                        batch.column("scores").to_pylist()):
            available[source] = available.get(source, 0) + rows
            kept = np.concatenate([smallest.get(source, np.empty(0, np.uint64)), np.array(scores, np.uint64)])
            if kept.size > 2 * bound:  # trim now and then: at most 2 x bound scores per source
                kept = np.partition(kept, bound - 1)[:bound]
            smallest[source] = kept

    available = dict(sorted(available.items()))
    quotas = source_quotas(available, sample, per_source.max_rows, per_source.weights)
    if per_source.weights is not None:
        unknown = sorted(set(per_source.weights) - set(available) - {"*"})
        if unknown:
            log.warning("source.per_source.weights names sources that have no rows: %s", unknown)
    # Keep a row when its score <= its source's threshold: -1 keeps none, 2**64 all.
    thresholds = {}
    for source, quota in quotas.items():
        if quota >= available[source]:
            thresholds[source] = 2**64
        elif quota == 0:
            thresholds[source] = -1
        else:
            thresholds[source] = int(np.sort(smallest[source])[quota - 1])
    figures = {s: {"available": available[s], "quota": quotas[s]} for s in available}
    log.info("per-source sample (%d rows of %d): %s", sum(quotas.values()), sum(available.values()), figures)
    if all(t == 2**64 for t in thresholds.values()):
        return ds, figures

    return ds.map_batches(BelowThresholds(seed, thresholds, default=-1), batch_format="pyarrow"), figures


class SmallestScores(Stage):
    """A block's n smallest sample scores (the driver merges them)."""

    reads = columns("row_id")
    makes = columns("score")

    def __init__(self, seed: int, n: int):
        self.seed, self.n = seed, n

    def apply(self, batch: pa.Table) -> pa.Table:
        keep = np.sort(sample_scores(batch.column("row_id").to_pylist(), self.seed))[:self.n]
        return pa.table({"score": pa.array(keep, pa.uint64())})


class BlockScores(Stage):
    """Per source of a block: its rows, and its `bound` smallest sample scores."""

    reads = columns("row_id", "source")
    makes = columns("source", "rows", "scores")

    def __init__(self, seed: int, bound: int):
        self.seed, self.bound = seed, bound

    def apply(self, batch: pa.Table) -> pa.Table:
        by_source: dict[str, list[int]] = {}
        scores = sample_scores(batch.column("row_id").to_pylist(), self.seed).tolist()
        for source, score in zip(batch.column("source").to_pylist(), scores):
            by_source.setdefault(source, []).append(score)
        sources = sorted(by_source)
        return pa.table({
            "source": pa.array(sources, pa.string()),
            "rows": pa.array([len(by_source[s]) for s in sources], pa.int64()),
            "scores": pa.array([np.sort(np.array(by_source[s], np.uint64))[:self.bound] for s in sources],
                               pa.list_(pa.uint64())),
        })


class BelowThresholds(Stage):
    """The rows whose sample score <= their source's threshold (`default` for the others)."""

    reads = columns("row_id", "source")

    def __init__(self, seed: int, thresholds: dict[str, int], default: int):
        self.seed, self.thresholds, self.default = seed, thresholds, default

    def apply(self, batch: pa.Table) -> pa.Table:
        scores = sample_scores(batch.column("row_id").to_pylist(), self.seed).tolist()
        keep = [score <= self.thresholds.get(source, self.default)
                for source, score in zip(batch.column("source").to_pylist(), scores)]
        return batch.filter(pa.array(keep, pa.bool_()))
