"""source.per_source: source-balanced sampling (quotas per source, then the baseline's
seeded score within each source)."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from support import SAMPLE, job_config, layouts, read_layout, sharegpt
from eagle_data.config import load_config
from eagle_data.errors import ConfigError, OutputMismatch
from eagle_data.job.fingerprints import prompt_config
from eagle_data.job.phases.run import run
from eagle_data.job.stages.sample import sample_scores, select_per_source, source_quotas

# --- quotas: pure arithmetic on the per-source row counts ---------------------------------


def test_equal_weights_by_default_with_largest_remainder():
    assert source_quotas({"a": 100, "b": 100, "c": 100}, 10) == {"a": 4, "b": 3, "c": 3}
    assert source_quotas({"a": 100, "b": 100, "c": 100}, 9) == {"a": 3, "b": 3, "c": 3}


def test_given_weights_and_star():
    available = {"a": 100, "b": 100, "metamath": 100, "x": 100}
    assert source_quotas(available, 25, weights={"*": 1, "metamath": 0.5, "x": 0}) == \
        {"a": 10, "b": 10, "metamath": 5, "x": 0}
    # Without "*", a source with no weight gets nothing.
    assert source_quotas(available, 30, weights={"a": 2, "b": 1}) == {"a": 20, "b": 10, "metamath": 0, "x": 0}


def test_water_filling_when_a_source_is_short():
    # b holds 3 rows: the 7 it cannot take go to a, c, m by their weights (1, 1, 0.5):
    # 17 x (0.4, 0.4, 0.2) = 6.8, 6.8, 3.4 -> 6, 6, 3 + the 2 largest remainders (a, c).
    assert source_quotas({"a": 100, "b": 3, "c": 100, "m": 100}, 20, weights={"*": 1, "m": 0.5}) == \
        {"a": 7, "b": 3, "c": 7, "m": 3}
    # Capped by max_rows too, in cascade: c is short after b filled up.
    assert source_quotas({"a": 100, "b": 2, "c": 6, "d": 100}, 40, max_rows=15) == \
        {"a": 15, "b": 2, "c": 6, "d": 15}
    # Fewer rows than asked for: everything available (of the weighted sources).
    assert source_quotas({"a": 1, "b": 3, "z": 50}, 20, weights={"a": 1, "b": 1}) == {"a": 1, "b": 3, "z": 0}


def test_max_rows_only():
    assert source_quotas({"a": 100, "b": 3, "": 7}, None, max_rows=5) == {"a": 5, "b": 3, "": 5}
    with pytest.raises(ValueError, match="sample is None"):
        source_quotas({"a": 100}, None, max_rows=5, weights={"a": 1})


def test_totals_capacities_and_key_order_on_random_counts():
    rng = random.Random(0)
    for _ in range(300):
        available = {f"s{i}": rng.choice([0, 1, 2, 5, 40, 1000]) for i in range(rng.randint(1, 8))}
        sample = rng.randint(1, 300)
        max_rows = rng.choice([None, 1, 7, 60])
        weights = rng.choice([None, {"*": 1, "s0": 0.25}, {"s1": 3, "s2": 0.1, "s3": 0},
                              {"*": 0.3, "s4": 2.5}])
        quotas = source_quotas(available, sample, max_rows, weights)
        capacity = {s: min(n, max_rows or n) for s, n in available.items()}
        weight = {s: 1 if weights is None else weights.get(s, weights.get("*", 0)) for s in available}
        takers = sum(capacity[s] for s in available if weight[s] > 0)
        assert sum(quotas.values()) == min(sample, takers)
        assert all(0 <= quotas[s] <= capacity[s] for s in available)
        assert all(quotas[s] == 0 for s in available if weight[s] == 0)
        # Water-filling: a source below its capacity got no less, per weight, than any other
        # (up to the rounding of one row each).
        for s in available:
            if weight[s] > 0 and quotas[s] < capacity[s]:
                for t in available:
                    if weight[t] > 0:
                        assert (quotas[t] - 1) / weight[t] <= (quotas[s] + 1) / weight[s]
        # Deterministic from the counts alone, not from their order.
        assert source_quotas(dict(reversed(available.items())), sample, max_rows, weights) == quotas


@pytest.mark.parametrize("sets, message", [
    (["source.per_source={weights: {a: 1}}"], "source.per_source.weights shares out source.sample, which is null"),
    (["source.per_source={}"], "source.per_source needs source.sample or source.per_source.max_rows"),
    (["source.sample=5", "source.per_source={weights: {a: 0}}"], "gives no source a positive weight"),
    (["source.sample=5", "source.per_source={weights: {a: -1}}"],
     "source.per_source.weights.a: Input should be greater than or equal to 0"),
    (["source.sample=5", "source.per_source={max_row: 3}"], "source.per_source.max_row: unknown key"),
    (["source.per_source.max_rows=0"], "source.per_source.max_rows: Input should be greater than or equal to 1"),
])
def test_config_errors_name_the_key(sets, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path=/m", "output.path=/o", *sets])
    assert message in str(e.value)


def test_prompt_config_has_per_source_only_when_set():
    """OUTs made before per_source existed keep matching; setting it is a prompt-config change."""
    base = ["model.path=/m", "output.path=/o", "source.sample=5"]
    assert "source.per_source" not in prompt_config(load_config(None, base))
    cfg = load_config(None, base + ["source.per_source={max_rows: 2, weights: {'*': 1}}"])
    assert prompt_config(cfg)["source.per_source"] == {"max_rows": 2, "weights": {"*": 1.0}}


# --- selection on a real local Ray over real files -----------------------------------------


def skewed_rows():
    """Sources of very different sizes, and rows without a source (source "")."""
    rng = random.Random(5)
    sizes = {"big": 200, "mid": 60, "small": 8, "metamath": 40}
    rows = [sharegpt(f"{source} question {i}: {rng.randint(0, 10**9)}?", source)
            for source, n in sizes.items() for i in range(n)]
    rows += [{"conversations": [{"from": "human", "value": f"no source {i}"}]} for i in range(6)]
    rng.shuffle(rows)
    return rows


def expected_selection(all_rows, quotas, seed):
    """Per source, the quota rows with the smallest scores, computed directly."""
    by_source: dict = {}
    for row_id, source in zip(all_rows["row_id"], all_rows["source"]):
        by_source.setdefault(source, []).append(row_id)
    chosen = []
    for source, row_ids in by_source.items():
        scores = sample_scores(row_ids, seed).tolist()
        chosen += [r for _, r in sorted(zip(scores, row_ids))[:quotas[source]]]
    return sorted(chosen)


def test_selection_is_per_source_smallest_scores_whatever_the_layout(ray_local, tmp_path):
    cfg = job_config(tmp_path / "out", "/unused", "/unused", source__sample=60,
                     source__per_source={"max_rows": 25, "weights": {"*": 1, "metamath": 0.5}}).source
    available = {"": 6, "big": 200, "metamath": 40, "mid": 60, "small": 8}
    quotas = source_quotas(available, 60, 25, {"*": 1, "metamath": 0.5})
    assert quotas == {"": 6, "big": 19, "metamath": 9, "mid": 18, "small": 8}
    for variants in layouts(tmp_path, skewed_rows()).values():
        picks = []
        for layout in variants:
            ds, figures = select_per_source(read_layout(cfg, *layout), cfg.sample, cfg.seed, cfg.per_source)
            assert figures == {s: {"available": available[s], "quota": quotas[s]} for s in available}
            picked = ds.to_pandas()
            assert Counter(picked["source"]) == +Counter(quotas)
            picks.append(sorted(picked["row_id"]))
        assert all(p == picks[0] for p in picks[1:])
        assert picks[0] == expected_selection(read_layout(cfg, *variants[0]).to_pandas(), quotas, cfg.seed)


def test_selection_at_quota_q_is_within_selection_at_q_plus_1(ray_local, tmp_path):
    cfg = job_config(tmp_path / "out", "/unused", "/unused", source__per_source={"max_rows": 9}).source
    dataset, repartition = layouts(tmp_path, skewed_rows())["jsonl"][2]  # 13 blocks from 5 files

    def selected(max_rows):
        per_source = cfg.per_source.model_copy(update={"max_rows": max_rows})
        ds, figures = select_per_source(read_layout(cfg, dataset, repartition), None, cfg.seed, per_source)
        picked = ds.to_pandas()
        assert Counter(picked["source"]) == {s: f["quota"] for s, f in figures.items()}
        return {s: set(picked["row_id"][picked["source"] == s]) for s in figures}

    at_9, at_10 = selected(9), selected(10)
    assert {s: len(r) for s, r in at_10.items()} == {"": 6, "big": 10, "metamath": 10, "mid": 10, "small": 8}
    assert all(at_9[s] <= at_10[s] for s in at_10)
    assert at_9["big"] < at_10["big"]


# --- the prompts phase and its manifest and report -------------------------------------------


def sources_of_sample() -> Counter:
    sources = Counter()
    for line in SAMPLE.read_text().splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            source = row.get("source") if isinstance(row, dict) else None
            sources[source if isinstance(source, str) else ""] += 1
    return sources


def test_prompts_phase_with_per_source_on_the_bundled_sample(ray_local, tmp_path, qwen3_tokenizer_dir):
    weights = {"*": 1, "meta-math/MetaMathQA": 0.5, "malformed-test": 0}
    cfg = job_config(tmp_path / "out", qwen3_tokenizer_dir, source__sample=20, sampling__max_tokens=256,
                     source__per_source={"max_rows": 4, "weights": weights})
    counts = run(cfg, phase="prompts")["prompts"]

    available = dict(sources_of_sample())
    quotas = source_quotas(available, 20, 4, weights)
    assert len([s for s in available if s not in ("", "malformed-test", "openai-format")]) == 6
    assert quotas["malformed-test"] == 0 and quotas["meta-math/MetaMathQA"] == 2
    assert counts["selected"] == sum(quotas.values()) == 20
    assert counts["sources"] == {s: {"available": n, "quota": quotas[s]} for s, n in sorted(available.items())}
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["phases"]["prompts"]["counts"]["sources"] == counts["sources"]
    assert manifest["phases"]["prompts"]["prompt_config"]["source.per_source"] == \
        {"max_rows": 4, "weights": {k: float(v) for k, v in weights.items()}}

    report = json.loads((out / "report.json").read_text())
    by_source = report["by_source"]
    assert set(by_source) == set(available)  # a source with quota 0 is listed too
    for source, n in available.items():
        figures = by_source[source]
        assert figures["available"] == n and figures["quota"] == quotas[source]
        assert figures["selected"] == quotas[source] == figures.get("prompts", 0) + figures.get("skipped", 0)

    # Another per_source setting would select other rows: refused for this OUT.
    changed = job_config(tmp_path / "out", qwen3_tokenizer_dir, source__sample=20, sampling__max_tokens=256,
                         source__per_source={"max_rows": 3, "weights": weights})
    with pytest.raises(OutputMismatch, match=r"changed: source\.per_source\)"):
        run(changed, phase="prompts")
