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
- Per temperature (acceptance.temperatures): every figure above, and the differences, at
  each temperature the prompts were asked at, each from its own rows of the same passes.
- Lossless: greedy speculative decoding must give the target's own greedy output; every
  prompt whose output with a draft differs is listed with the first position that differs.
  At temperature 0 only: sampled outputs follow the target's distribution, not its tokens.
- Throughput: a pass's generated tokens over its span in the engines (the first request's
  start to the last one's end, across the replicas; every temperature of the pass, asked
  together): tokens/s, and with a draft its ratio to the target's alone.
- Never NaN: a figure with nothing to count (no step proposed a draft token: every answer
  ended at its first token) is null, said in a note and in the table; report.json is
  strict JSON.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from eagle_data.evaluation.report_folder import write_atomically


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


def tau(steps: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """1 + accepted / steps over a set of prompts (sums over the last axis); NaN where no
    step was made (as_figure makes it null)."""
    total = steps.sum(-1)
    return np.where(total > 0, 1 + accepted.sum(-1) / np.maximum(total, 1), np.nan)


def as_figure(value) -> float | None:
    """A figure for the report: a float, or None where there was nothing to count."""
    value = float(value)
    return value if math.isfinite(value) else None


def resamples(n: int, times: int, seed: int) -> np.ndarray:
    """[times, n] prompt indices drawn with replacement: the bootstrap's resamples."""
    return np.random.default_rng(seed).integers(0, n, size=(times, n))


def interval(values: np.ndarray) -> list[float] | None:
    """The 95% percentile interval of a bootstrap statistic's values (None: none counted)."""
    values = values[np.isfinite(values)]
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))] if values.size else None


NO_STEP = ("no step proposed a draft token: every answer ended at its first token (sampling.max_tokens, or a stop "
           "token first)")


def tau_with_interval(counts: Counts, times: int, seed: int) -> dict:
    picks = resamples(len(counts.steps), times, seed)
    figures = {"prompts": len(counts.steps), "tau": as_figure(tau(counts.steps, counts.accepted)),
               "tau_95": interval(tau(counts.steps[picks], counts.accepted[picks]))}
    return figures if figures["tau"] is not None else {**figures, "note": NO_STEP}


def draft_figures(counts: Counts, times: int, seed: int) -> dict:
    """tau with its interval, acceptance by position, and the same tau per source."""
    drafted = counts.drafted_at.sum(0)
    return {**tau_with_interval(counts, times, seed),
            "steps": int(counts.steps.sum()), "accepted": int(counts.accepted.sum()),
            "acceptance_by_position": [float(a / d) if d else None for a, d in zip(counts.accepted_at.sum(0), drafted)],
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
        return {"prompts": len(a.steps), "difference": as_figure(tau(a.steps, a.accepted) - tau(b.steps, b.accepted)),
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


def tokens_per_s(rows: list[dict]) -> float | None:
    """A pass's generated tokens over its span in the engines (None: no span)."""
    span = max(r["engine_finished"] for r in rows) - min(r["engine_started"] for r in rows)
    return sum(len(r["generated_tokens"]) for r in rows) / span if span > 0 else None


def temperature_key(temperature: float) -> str:
    """A temperature as report.json's keys name it: `0`, `0.7`."""
    return f"{temperature:g}"


def at(rows: list[dict], temperature: float) -> list[dict]:
    """A pass's rows at one temperature, in sample_id order."""
    return sorted((r for r in rows if r["temperature"] == temperature), key=lambda r: r["sample_id"])


LOSSLESS = ("checked at temperature 0 only: greedy speculative decoding must give the target's own output; sampled "
            "outputs follow the target's distribution, not its tokens, and are not compared")


def report(passes: dict[str, list[dict]], target: list[dict] | None, k: int, temperatures: list[float], times: int,
           seed: int) -> dict:
    """The whole report (docs/acceptance.md, "report.json"): each draft's figures at each
    temperature (and against the target alone, when it ran), and the paired difference of
    every two drafts at each temperature."""
    names = list(passes)
    drafts = {name: {"by_temperature": {}} for name in names}
    differences = {}
    target_speed = tokens_per_s(target) if target else None
    for temperature in temperatures:
        key = temperature_key(temperature)
        counts = {name: Counts.of(at(rows, temperature), k) for name, rows in passes.items()}
        greedy_target = ({r["sample_id"]: list(r["generated_tokens"]) for r in at(target, temperature)}
                         if target and temperature == 0 else None)
        for name in names:
            figures = draft_figures(counts[name], times, seed)
            if greedy_target is not None:
                figures["lossless"] = lossless(at(passes[name], temperature), greedy_target)
            drafts[name]["by_temperature"][key] = figures
        differences[key] = {f"{a} - {b}": difference(counts[a], counts[b], times, seed)
                            for i, a in enumerate(names) for b in names[i + 1:]}
    for name, rows in passes.items():
        speed = tokens_per_s(rows)
        drafts[name]["tokens_per_s"] = speed
        if target:
            drafts[name]["speedup"] = speed / target_speed if speed and target_speed else None
    prompts = len({r["sample_id"] for rows in [*passes.values(), target or []] for r in rows})
    return {"prompts": prompts, "num_speculative_tokens": k, "temperatures": list(temperatures),
            "top_p": 1.0, "seed": seed, "bootstrap": {"resamples": times, "seed": seed},
            "lossless": LOSSLESS if 0 in temperatures and target else None,
            "target": {"tokens_per_s": target_speed} if target else None, "drafts": drafts,
            "differences": differences}


def number(value: float | None, form: str, none: str = "-") -> str:
    return none if value is None else format(value, form)


def span(values: list[float] | None, form: str) -> str:
    return "[-]" if values is None else f"[{format(values[0], form)}, {format(values[1], form)}]"


def table(figures: dict) -> str:
    """The report as the terminal shows it: a section per temperature."""
    k = figures["num_speculative_tokens"]
    temperatures = ", ".join(temperature_key(t) + (" (greedy)" if t == 0 else "") for t in figures["temperatures"])
    lines = [f"acceptance over {figures['prompts']} prompts at temperature {temperatures}, k = {k} (tau: tokens per "
             f"target step, bonus included; 95% bootstrap intervals over prompts)"]
    drafts = figures["drafts"]
    wide = max([len(name) for name in drafts] + [5])
    source_wide = max([len(s) for d in drafts.values() for t in d["by_temperature"].values() for s in t["by_source"]]
                      + [6])
    for temperature in figures["temperatures"]:
        key = temperature_key(temperature)
        kind = "greedy" if temperature == 0 else "sampled: top_p 1, a seed per prompt"
        lines.append(f"temperature {key} ({kind})")
        lines.append(f"{'draft':<{wide}}  {'source':<{source_wide}}  {'prompts':>7}  {'tau':>6}  "
                     f"{'95% interval':>15}")
        for name, d in drafts.items():
            at_t = d["by_temperature"][key]
            for source, f in [("all", at_t), *at_t["by_source"].items()]:
                lines.append(f"{name:<{wide}}  {source:<{source_wide}}  {f['prompts']:>7}  {number(f['tau'], '6.3f'):>6}"
                             f"  {span(f['tau_95'], '.3f'):>15}")
            by_position = ", ".join(number(a, ".3f") for a in at_t["acceptance_by_position"])
            checked = at_t.get("lossless")
            lossless_text = f", lossless {checked['equal']}/{checked['of']}" if checked else ""
            lines.append(f"{'':<{wide}}  acceptance by position {by_position}{lossless_text}")
            if "note" in at_t:
                lines.append(f"{'':<{wide}}  {at_t['note']}")
        for pair, diff in figures["differences"][key].items():
            lines.append(f"tau({pair.replace(' - ', ') - tau(')}) = {number(diff['difference'], '+.3f')} "
                         f"{span(diff['difference_95'], '+.3f')}"
                         + "".join(f"; {s} {number(d['difference'], '+.3f')} {span(d['difference_95'], '+.3f')}"
                                   for s, d in diff["by_source"].items()))
    for name, d in drafts.items():
        speedup = f" ({d['speedup']:.2f}x the target's)" if d.get("speedup") is not None else ""
        lines.append(f"{name}: {number(d['tokens_per_s'], '.1f')} tok/s{speedup}, its pass's every temperature")
    if figures["target"]:
        lines.append(f"target alone: {number(figures['target']['tokens_per_s'], '.1f')} tok/s")
    if figures["lossless"]:
        lines.append(f"lossless: {figures['lossless']}")
    return "\n".join(lines)


def plot(figures: dict, path: str) -> None:
    """acceptance.png: per temperature, acceptance by position, and tau by source with its
    interval, per draft (a figure with nothing counted is left out, not drawn as 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafts = figures["drafts"]
    temperatures = figures["temperatures"]
    k = figures["num_speculative_tokens"]
    fig, axes = plt.subplots(len(temperatures), 2, figsize=(11, 4 * len(temperatures)), squeeze=False)
    width = 0.8 / max(1, len(drafts))
    for (left, right), temperature in zip(axes, temperatures):
        key = temperature_key(temperature)
        for i, (name, d) in enumerate(drafts.items()):
            at_t = d["by_temperature"][key]
            positions = [(p, a) for p, a in enumerate(at_t["acceptance_by_position"], 1) if a is not None]
            left.bar([p + i * width for p, _ in positions], [a for _, a in positions], width, label=name)
            sources = [s for s, f in at_t["by_source"].items() if f["tau"] is not None]
            taus = [at_t["by_source"][s]["tau"] for s in sources]
            errors = np.array([[t - at_t["by_source"][s]["tau_95"][0], at_t["by_source"][s]["tau_95"][1] - t]
                               for s, t in zip(sources, taus)]).reshape(-1, 2).T
            right.errorbar(np.arange(len(sources)) + i * width, taus, yerr=errors, fmt="o", capsize=3, label=name)
            right.set_xticks(np.arange(len(sources)) + width * (len(drafts) - 1) / 2, sources, rotation=30, ha="right")
        left.set_xticks(np.arange(1, k + 1) + width * (len(drafts) - 1) / 2, [str(i) for i in range(1, k + 1)])
        left.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1),
                 title=f"acceptance by position, temperature {key}")
        right.set(ylabel="tau (tokens per target step)",
                  title=f"mean acceptance length by source (95% interval), temperature {key}")
        left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def write(figures: dict, rows: dict[str, list[dict]], folder: str) -> None:
    """report.json (strict JSON: no NaN), per_prompt.jsonl (each draft's counts and output
    per prompt and temperature) and acceptance.png in `folder`, each written aside and
    renamed into place."""
    per_prompt = "".join(json.dumps({"draft": name, **{k: r[k] for k in (
        "temperature", "sample_id", "source", "spec_accepted", "spec_drafted", "generated_tokens")}},
        allow_nan=False) + "\n" for name, draft_rows in rows.items() for r in draft_rows)
    write_atomically(os.path.join(folder, "report.json"), json.dumps(figures, indent=2, allow_nan=False) + "\n")
    write_atomically(os.path.join(folder, "per_prompt.jsonl"), per_prompt)
    write_atomically(os.path.join(folder, "acceptance.png"), lambda aside: plot(figures, aside))
