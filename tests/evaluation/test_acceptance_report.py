"""The acceptance job's figures (eagle_data/evaluation/acceptance_report.py) from per-prompt
counts: the same numbers vLLM's own definitions give (its per-request and per-step spec
decode statistics, vllm/v1/metrics/stats.py and vllm/v1/spec_decode/metrics.py), intervals
that cover what they claim, the lossless check, and the files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle_data.evaluation.acceptance_report import Counts, difference, lossless, report, table, tau, write

K = 3


def row(sample_id: str, source: str, accepted: list[int], drafted: list[int] | None = None, tokens=None,
        temperature: float = 0.0) -> dict:
    drafted = [K] * len(accepted) if drafted is None else drafted
    return {"sample_id": sample_id, "source": source, "temperature": temperature, "spec_accepted": accepted,
            "spec_drafted": drafted,
            "generated_tokens": tokens if tokens is not None else list(range(1 + sum(a + 1 for a in accepted))),
            "engine_started": 100.0, "engine_finished": 102.0}


@pytest.mark.vllm  # imports vLLM (15 s): not in the fast subset
def test_tau_and_acceptance_by_position_are_vllms():
    """Per prompt, tau is vLLM's RequestSpecDecodeMetrics mean_acceptance_length; over prompts,
    the acceptance at each position is vLLM's num_accepted_tokens_per_pos / num_drafts
    (SpecDecodingStats), and tau vLLM's 1 + accepted / drafts."""
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    prompts = [[0, 3, 1, 2, 0], [3, 3, 2], [1], [0, 0, 0, 1]]
    rows = [row(f"p{i}", "s", a) for i, a in enumerate(prompts)]
    counts = Counts.of(rows, K)
    stats = SpecDecodingStats.new(K)
    for i, accepted in enumerate(prompts):
        metrics = RequestSpecDecodeMetrics.new(K)
        for a in accepted:
            metrics.observe(K, a)
            stats.observe_draft(K, a)
        assert tau(counts.steps[i], counts.accepted[i]) == pytest.approx(metrics.to_dict()["mean_acceptance_length"])
    assert float(tau(counts.steps, counts.accepted)) == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)
    figures = report({"d": rows}, None, K, [0.0], times=200, seed=0)["drafts"]["d"]["by_temperature"]["0"]
    assert figures["acceptance_by_position"] == pytest.approx(
        [n / stats.num_drafts for n in stats.num_accepted_tokens_per_pos])
    # Fewer tokens proposed at some steps (a short draft near max_tokens): counted per position drafted.
    short = Counts.of([row("p", "s", [2, 1], drafted=[3, 1])], K)
    assert short.drafted_at.tolist() == [[2, 1, 1]] and short.accepted_at.tolist() == [[2, 1, 0]]


def test_the_95_percent_interval_covers_tau_about_95_times_in_100():
    """Prompts drawn from a known process (each step accepts j tokens with fixed odds), 200
    times over: the percentile bootstrap's interval over 60 prompts covers the process's own
    tau in 88-99% of the draws (95% nominal; a binomial 95% band around 190 of 200)."""
    rng = np.random.default_rng(1)
    odds = np.array([0.4, 0.3, 0.2, 0.1])  # P(j accepted), j = 0..3
    truth = 1 + (np.arange(4) * odds).sum()
    covered = 0
    for draw in range(200):
        rows = [row(f"p{i}", "s", list(rng.choice(4, size=rng.integers(5, 40), p=odds))) for i in range(60)]
        lo, hi = report({"d": rows}, None, K, [0.0], times=400, seed=draw)["drafts"]["d"]["by_temperature"]["0"]["tau_95"]
        covered += lo <= truth <= hi
    assert 176 <= covered <= 198, covered


def test_a_paired_difference_of_a_draft_with_itself_is_zero_and_per_source():
    rows_a = [row(f"p{i}", "gsm8k" if i % 2 else "mt_bench", [i % 4, 1, 2]) for i in range(10)]
    rows_b = [row(f"p{i}", "gsm8k" if i % 2 else "mt_bench", [0, 0, i % 2]) for i in range(10)]
    a, b = Counts.of(rows_a, K), Counts.of(rows_b, K)
    same = difference(a, a, 300, 0)
    assert same["difference"] == 0 and same["difference_95"] == [0, 0]
    diff = difference(a, b, 300, 0)
    assert diff["difference"] == pytest.approx(float(tau(a.steps, a.accepted) - tau(b.steps, b.accepted)))
    assert diff["difference_95"][0] <= diff["difference"] <= diff["difference_95"][1]
    assert set(diff["by_source"]) == {"gsm8k", "mt_bench"} and diff["by_source"]["gsm8k"]["prompts"] == 5


def test_an_output_that_differs_from_the_targets_is_named_with_its_first_difference():
    rows = [row("p0", "s", [1], tokens=[5, 6, 7]), row("p1", "s", [1], tokens=[5, 9, 7]), row("p2", "s", [0], tokens=[5])]
    checked = lossless(rows, {"p0": [5, 6, 7], "p1": [5, 6, 7], "p2": [5, 6]})
    assert checked["equal"] == 1 and checked["of"] == 3
    assert checked["mismatches"] == [{"sample_id": "p1", "first_difference": 1, "tokens": [3, 3]},
                                     {"sample_id": "p2", "first_difference": 1, "tokens": [1, 2]}]


def test_the_report_files_and_table_per_temperature(tmp_path):
    """Two drafts at temperatures 0 and 0.7 over the same prompts: figures and differences per
    temperature, the lossless check at 0 only, one throughput per pass (every temperature)."""
    rows = {name: [row(f"p{i}", "gsm8k" if i % 2 else "mt_bench", [i % 4 if name == "a" else 0] * 3, temperature=t)
                   for i in range(6) for t in (0.0, 0.7)] for name in ("a", "b")}
    target = [{**r, "engine_started": 100.0, "engine_finished": 104.0} for r in rows["a"]]
    target[1] = {**target[1], "generated_tokens": [t + 1 for t in target[1]["generated_tokens"]]}  # p0 at 0.7:
    # sampled outputs are not compared
    figures = report(rows, target, K, [0.0, 0.7], 300, 0)
    write(figures, rows, str(tmp_path))
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["temperatures"] == [0.0, 0.7] and "temperature 0 only" in written["lossless"]
    a = written["drafts"]["a"]
    assert a["by_temperature"]["0"]["lossless"]["equal"] == 6 and "lossless" not in a["by_temperature"]["0.7"]
    assert a["by_temperature"]["0"]["tau"] == a["by_temperature"]["0.7"]["tau"] > 1  # the same counts at both
    assert set(written["differences"]) == {"0", "0.7"} and written["differences"]["0.7"]["a - b"]["difference"] > 0
    assert figures["drafts"]["a"]["speedup"] == pytest.approx(2.0)  # the same tokens in half the target's span
    lines = [json.loads(line) for line in (tmp_path / "per_prompt.jsonl").read_text().splitlines()]
    assert len(lines) == 24 and {line["temperature"] for line in lines} == {0.0, 0.7}
    assert (tmp_path / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acceptance.png", "per_prompt.jsonl", "report.json"]
    text = table(figures)
    assert "temperature 0 (greedy)" in text and "temperature 0.7 (sampled" in text
    assert "tau(a) - tau(b) = +" in text and "mt_bench" in text and "lossless 6/6" in text


def test_no_step_that_proposed_a_token_is_a_sentence_never_nan(tmp_path):
    """Every answer ended at its first token (sampling.max_tokens 1, or a stop token first):
    no step, so no tau: null in report.json (strict JSON: NaN is refused), a note and a line
    in the table, and a plot without it. Was: tau `nan [nan, nan]` and `NaN` in report.json."""
    rows = {"a": [row(f"p{i}", "s", [], tokens=[1]) for i in range(4)],
            "b": [row(f"p{i}", "s", [1, 2]) for i in range(4)]}
    figures = report(rows, None, K, [0.0], 300, 0)
    write(figures, rows, str(tmp_path))
    text = (tmp_path / "report.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    a = figures["drafts"]["a"]["by_temperature"]["0"]
    assert a["tau"] is None and a["tau_95"] is None and a["acceptance_by_position"] == [None] * K
    assert a["note"].startswith("no step proposed a draft token") and a["by_source"]["s"]["tau"] is None
    assert figures["differences"]["0"]["a - b"]["difference"] is None
    assert "nan" not in table(figures).lower() and "no step proposed a draft token" in table(figures)
    assert (tmp_path / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
