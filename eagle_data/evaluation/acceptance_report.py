"""The acceptance job's figures, from each prompt's counts (acceptance.py): what the field
reports for a draft, the way vLLM defines it (vllm/v1/spec_decode/metrics.py).

- Mean acceptance length tau = 1 + accepted / steps: the tokens each step of the target
  yields, the bonus token included (a step proposes k draft tokens; `accepted` of them are
  the target's own, then the target's token follows). Over a set of prompts it is the ratio
  of the sums, as vLLM's counters give it, not the mean of the prompts' ratios.
- Acceptance at position i (1..k): of the steps that proposed an i-th draft token, the share
  where it was accepted (the i - 1 before it were too).
- 95% intervals: percentile bootstrap over prompts (the prompts of a source resampled with
  replacement `bootstrap` times, seeded; the statistic recomputed from the resampled sums;
  the 2.5th and 97.5th percentiles). A difference between two drafts is paired: the same
  resampled prompts for both, since both answered the same prompts.
- Lossless: greedy speculative decoding must give the target's own greedy output; every
  prompt whose output with a draft differs is listed with the first position that differs.
- Throughput: a pass's generated tokens over its span in the engines (the first request's
  start to the last one's end, across the replicas): tokens/s, and with a draft its ratio
  to the target's alone.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np


@dataclass
class Counts:
    """One draft's counts over the prompts, as arrays aligned on `sample_ids`: steps and
    accepted tokens per prompt, and per position (columns 0..k-1) the steps that proposed a
    token there and those where it was accepted."""

    sample_ids: list[str]
    sources: list[str]
    steps: np.ndarray  # [prompts]
    accepted: np.ndarray  # [prompts]
    drafted_at: np.ndarray  # [prompts, k]
    accepted_at: np.ndarray  # [prompts, k]

    @classmethod
    def of(cls, rows: list[dict], k: int) -> "Counts":
        """From the engine's rows (their `spec_accepted` and `spec_drafted` per step)."""
        positions = np.arange(1, k + 1)
        drafted_at, accepted_at = [], []
        for row in rows:
            a, d = np.asarray(row["spec_accepted"], int), np.asarray(row["spec_drafted"], int)
            accepted_at.append((a[:, None] >= positions).sum(0) if a.size else np.zeros(k, int))
            drafted_at.append((d[:, None] >= positions).sum(0) if d.size else np.zeros(k, int))
        return cls([r["sample_id"] for r in rows], [r["source"] for r in rows],
                   np.array([len(r["spec_accepted"]) for r in rows], float),
                   np.array([sum(r["spec_accepted"]) for r in rows], float),
                   np.array(drafted_at, float).reshape(len(rows), k), np.array(accepted_at, float).reshape(len(rows), k))

    def where(self, keep: np.ndarray) -> "Counts":
        return Counts([s for s, k in zip(self.sample_ids, keep) if k], [s for s, k in zip(self.sources, keep) if k],
                      self.steps[keep], self.accepted[keep], self.drafted_at[keep], self.accepted_at[keep])


def tau(steps: np.ndarray, accepted: np.ndarray) -> float:
    """1 + accepted / steps over a set of prompts (sums over the last axis)."""
    total = steps.sum(-1)
    return np.where(total > 0, 1 + accepted.sum(-1) / np.maximum(total, 1), np.nan)


def resamples(n: int, times: int, seed: int) -> np.ndarray:
    """[times, n] prompt indices drawn with replacement: the bootstrap's resamples."""
    return np.random.default_rng(seed).integers(0, n, size=(times, n))


def interval(values: np.ndarray) -> list[float]:
    """The 95% percentile interval of a bootstrap statistic's values."""
    values = values[np.isfinite(values)]
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))] if values.size else [math.nan] * 2


def tau_with_interval(counts: Counts, times: int, seed: int) -> dict:
    picks = resamples(len(counts.steps), times, seed)
    return {"prompts": len(counts.steps), "tau": float(tau(counts.steps, counts.accepted)),
            "tau_95": interval(tau(counts.steps[picks], counts.accepted[picks]))}


def draft_figures(counts: Counts, times: int, seed: int) -> dict:
    """tau with its interval, acceptance by position, and the same tau per source."""
    drafted = counts.drafted_at.sum(0)
    return {**tau_with_interval(counts, times, seed),
            "steps": int(counts.steps.sum()), "accepted": int(counts.accepted.sum()),
            "acceptance_by_position": [float(a / d) if d else math.nan for a, d in zip(counts.accepted_at.sum(0), drafted)],
            "by_source": {source: tau_with_interval(counts.where(np.array([s == source for s in counts.sources])),
                                                    times, seed)
                          for source in sorted(set(counts.sources))}}


def difference(first: Counts, second: Counts, times: int, seed: int) -> dict:
    """tau(first) - tau(second) over the same prompts, with a paired bootstrap interval,
    overall and per source."""
    assert first.sample_ids == second.sample_ids

    def paired(keep: np.ndarray) -> dict:
        a, b = first.where(keep), second.where(keep)
        picks = resamples(len(a.steps), times, seed)
        values = tau(a.steps[picks], a.accepted[picks]) - tau(b.steps[picks], b.accepted[picks])
        return {"prompts": len(a.steps), "difference": float(tau(a.steps, a.accepted) - tau(b.steps, b.accepted)),
                "difference_95": interval(values)}

    everything = np.ones(len(first.steps), bool)
    return {**paired(everything), "by_source": {
        source: paired(np.array([s == source for s in first.sources])) for source in sorted(set(first.sources))}}


def lossless(rows: list[dict], target: dict[str, list[int]]) -> dict:
    """Whether each output with the draft is the target's own greedy output."""
    mismatches = []
    for row in rows:
        mine, theirs = list(row["generated_tokens"]), target[row["sample_id"]]
        if mine != theirs:
            first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            mismatches.append({"sample_id": row["sample_id"], "first_difference": first,
                               "tokens": [len(mine), len(theirs)]})
    return {"equal": len(rows) - len(mismatches), "of": len(rows), "mismatches": mismatches}


def tokens_per_s(rows: list[dict]) -> float:
    """A pass's generated tokens over its span in the engines."""
    span = max(r["engine_finished"] for r in rows) - min(r["engine_started"] for r in rows)
    return sum(len(r["generated_tokens"]) for r in rows) / span if span > 0 else math.nan


def report(passes: dict[str, list[dict]], target: list[dict] | None, k: int, times: int, seed: int) -> dict:
    """The whole report: each draft's figures (and against the target alone, when it ran),
    and the paired difference of every two drafts."""
    counts = {name: Counts.of(sorted(rows, key=lambda r: r["sample_id"]), k) for name, rows in passes.items()}
    target_ids = {r["sample_id"]: list(r["generated_tokens"]) for r in target} if target else None
    drafts = {}
    for name, rows in passes.items():
        figures = {**draft_figures(counts[name], times, seed), "tokens_per_s": tokens_per_s(rows)}
        if target_ids is not None:
            figures["lossless"] = lossless(rows, target_ids)
            figures["speedup"] = figures["tokens_per_s"] / tokens_per_s(target)
        drafts[name] = figures
    names = list(passes)
    return {"num_speculative_tokens": k, "prompts": len(next(iter(counts.values())).steps) if counts else 0,
            "bootstrap": {"resamples": times, "seed": seed},
            "target": {"tokens_per_s": tokens_per_s(target)} if target else None, "drafts": drafts,
            "differences": {f"{a} - {b}": difference(counts[a], counts[b], times, seed)
                            for i, a in enumerate(names) for b in names[i + 1:]}}


def table(figures: dict) -> str:
    """The report as the terminal shows it."""
    k = figures["num_speculative_tokens"]
    lines = [f"acceptance over {figures['prompts']} prompts, k = {k} (tau: tokens per target step, bonus "
             f"included; 95% bootstrap intervals over prompts)"]
    wide = max([len(name) for name in figures["drafts"]] + [5])
    source_wide = max([len(s) for d in figures["drafts"].values() for s in d["by_source"]] + [6])
    lines.append(f"{'draft':<{wide}}  {'source':<{source_wide}}  {'prompts':>7}  {'tau':>6}  {'95% interval':>15}")
    for name, d in figures["drafts"].items():
        rows = [("all", d), *d["by_source"].items()]
        for source, f in rows:
            lo, hi = f["tau_95"]
            lines.append(f"{name:<{wide}}  {source:<{source_wide}}  {f['prompts']:>7}  {f['tau']:>6.3f}  "
                         f"{f'[{lo:.3f}, {hi:.3f}]':>15}")
        by_position = ", ".join(f"{a:.3f}" for a in d["acceptance_by_position"])
        speed = f", {d['tokens_per_s']:.1f} tok/s" + (f" ({d['speedup']:.2f}x the target's)" if "speedup" in d else "")
        checked = d.get("lossless")
        lossless_text = f", lossless {checked['equal']}/{checked['of']}" if checked else ""
        lines.append(f"{'':<{wide}}  acceptance by position {by_position}{speed}{lossless_text}")
    if figures["target"]:
        lines.append(f"target alone: {figures['target']['tokens_per_s']:.1f} tok/s")
    for pair, diff in figures["differences"].items():
        lo, hi = diff["difference_95"]
        lines.append(f"tau({pair.replace(' - ', ') - tau(')}) = {diff['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
                     + "".join(f"; {s} {d['difference']:+.3f} [{d['difference_95'][0]:+.3f}, "
                               f"{d['difference_95'][1]:+.3f}]" for s, d in diff["by_source"].items()))
    return "\n".join(lines)


def plot(figures: dict, path: str) -> None:
    """acceptance.png: acceptance by position, and tau by source with its interval, per draft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafts = figures["drafts"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(drafts))
    k = figures["num_speculative_tokens"]
    for i, (name, d) in enumerate(drafts.items()):
        left.bar(np.arange(1, k + 1) + i * width, d["acceptance_by_position"], width, label=name)
        sources = list(d["by_source"])
        taus = [d["by_source"][s]["tau"] for s in sources]
        errors = np.array([[t - d["by_source"][s]["tau_95"][0], d["by_source"][s]["tau_95"][1] - t]
                           for s, t in zip(sources, taus)]).T
        right.errorbar(np.arange(len(sources)) + i * width, taus, yerr=errors, fmt="o", capsize=3, label=name)
        right.set_xticks(np.arange(len(sources)) + width * (len(drafts) - 1) / 2, sources, rotation=30, ha="right")
    left.set_xticks(np.arange(1, k + 1) + width * (len(drafts) - 1) / 2, [str(i) for i in range(1, k + 1)])
    left.set(xlabel="draft position", ylabel="acceptance rate", title="acceptance by position", ylim=(0, 1))
    right.set(ylabel="tau (tokens per target step)", title="mean acceptance length by source (95% interval)")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(figures: dict, rows: dict[str, list[dict]], folder: str) -> None:
    """report.json, per_prompt.jsonl (each draft's counts and output per prompt) and
    acceptance.png in `folder`, each written aside and renamed into place."""
    os.makedirs(folder, exist_ok=True)
    files = {"report.json": json.dumps(figures, indent=2) + "\n",
             "per_prompt.jsonl": "".join(json.dumps({"draft": name, **{k: r[k] for k in (
                 "sample_id", "source", "spec_accepted", "spec_drafted", "generated_tokens")}}) + "\n"
                                         for name, draft_rows in rows.items() for r in draft_rows)}
    for name, text in files.items():
        with open(os.path.join(folder, f".{name}.tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(folder, f".{name}.tmp"), os.path.join(folder, name))
    plot(figures, os.path.join(folder, ".acceptance.png.tmp.png"))
    os.replace(os.path.join(folder, ".acceptance.png.tmp.png"), os.path.join(folder, "acceptance.png"))
