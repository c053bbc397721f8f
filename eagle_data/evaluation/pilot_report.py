"""The pilot's report (pilot.py): what each recipe's draft is worth when served, and what the
recipe cost, from the stages' own outputs.

- tau (acceptance_report.py's definition) of each recipe's final draft, overall and per
  source, with its 95% bootstrap interval, at each temperature the acceptance job measured;
- each recipe's paired difference with the baseline (the first recipe) and with every
  recipe of pilot.compare_to: the same resampled prompts for both; an interval that holds 0
  is no difference;
- tau by training step for the recipes whose checkpoints were measured (pilot.measure_steps);
- what each recipe cost: its rows and generated tokens (data/), its stages' wall time, the
  steps its draft trained and its last training loss;
- the lossless check (greedy), as the acceptance job made it.
Written as report.json and report.png in pilot.path; `table` is the terminal's.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads

from eagle_data.evaluation.acceptance_report import Counts, difference, draft_figures, number, span, temperature_key
from eagle_data.storage.files import filesystem
from eagle_data.storage.shards import shard_files


def per_prompt(path: Path) -> dict[tuple[float, str], list[dict]]:
    """The acceptance job's per-prompt rows, by (temperature, draft)."""
    rows: dict[tuple[float, str], list[dict]] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            rows.setdefault((float(row["temperature"]), row["draft"]), []).append(row)
    return rows


def recipe_cost(out: str) -> dict:
    """A recipe OUT's rows and generated tokens (data/)."""
    fs, root = filesystem(out)
    files = shard_files(fs, f"{root}/data")
    if not files:
        return {"rows": 0, "generated_tokens": 0}
    table = pads.dataset(files, filesystem=fs, format="parquet").to_table(
        columns=["num_reasoning_tokens", "num_response_tokens"])
    tokens = sum(int(np.sum(table.column(c).to_numpy())) for c in ("num_reasoning_tokens", "num_response_tokens"))
    return {"rows": table.num_rows, "generated_tokens": tokens}


def training(save_path: str) -> dict:
    """The steps a draft trained and its last logged training loss (metrics.jsonl)."""
    steps, loss = 0, None
    with open(os.path.join(save_path, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if "step" in record and "validation" not in record:
                steps, loss = record["step"], record.get("loss", loss)
    return {"steps": steps, "loss": loss}


def report(recipes: list[str], compare_to: list[str], records: dict, folders: dict[str, dict],
           acceptance_path: Path, times: int, seed: int) -> dict:
    """The whole report (module docstring). `records`: pilot.json's stages; `folders`: each
    recipe's OUT and draft folder."""
    rows = per_prompt(acceptance_path / "per_prompt.jsonl")
    accepted = json.loads((acceptance_path / "report.json").read_text())
    k = accepted["num_speculative_tokens"]
    temperatures = sorted({t for t, _ in rows})
    cost = {}
    for name in recipes:
        stage_seconds = {kind: records.get(f"{kind}:{name}", {}).get("seconds") for kind in ("generate", "train")}
        cost[name] = {**recipe_cost(folders[name]["out"]), **training(folders[name]["draft"]),
                      "seconds": stage_seconds}
    measured = {}
    for temperature in temperatures:
        counts = {draft: Counts.of(sorted(r, key=lambda r: r["sample_id"]), k)
                  for (t, draft), r in rows.items() if t == temperature}
        finals = {name: draft_figures(counts[name], times, seed) for name in recipes if name in counts}
        differences = {f"{name} - {ref}": difference(counts[name], counts[ref], times, seed)
                       for name, ref in pairs(recipes, compare_to) if name in counts and ref in counts}
        by_step = {}
        for name in recipes:
            steps = sorted(int(d.split("@")[1]) for d in counts if d.startswith(f"{name}@"))
            if steps:
                points = [(step, counts[f"{name}@{step}"]) for step in steps]
                points.append((cost[name]["steps"], counts[name]))
                by_step[name] = [{"step": step, **{key: f[key] for key in ("tau", "tau_95")}}
                                 for step, c in points for f in [draft_figures(c, times, seed)]]
        measured[temperature_key(temperature)] = {"drafts": finals, "differences": differences, "by_step": by_step}
    lossless = {name: accepted["drafts"][name]["by_temperature"].get("0", {}).get("lossless") for name in recipes
                if name in accepted["drafts"]}
    return {"recipes": recipes, "baseline": recipes[0], "compare_to": compare_to, "num_speculative_tokens": k,
            "prompts": len(next(iter(rows.values()))) if rows else 0, "temperatures": temperatures,
            "bootstrap": {"resamples": times, "seed": seed}, "cost": cost, "tau": measured, "lossless": lossless,
            "stage_seconds": {name: r.get("seconds") for name, r in records.items()}}


def pairs(recipes: list[str], compare_to: list[str]) -> list[tuple[str, str]]:
    """(recipe, reference) for every recipe against each of compare_to, each two recipes once
    (greedy - dataset, not also dataset - greedy)."""
    found = []
    for ref in compare_to:
        found += [(name, ref) for name in recipes if name != ref and (ref, name) not in found]
    return found


def table(figures: dict) -> str:
    """The report as the terminal shows it: per temperature, each recipe's tau (overall and by
    source) with intervals, its differences, tau by step; then what each recipe cost."""
    lines = [f"pilot: {len(figures['recipes'])} recipes, baseline {figures['baseline']}; tau at k = "
             f"{figures['num_speculative_tokens']} over {figures['prompts']} held-out prompts (95% intervals; a "
             "difference whose interval holds 0 is none)"]
    for temperature, m in figures["tau"].items():
        lines.append(f"temperature {temperature}:")
        wide = max(len(n) for n in figures["recipes"])
        for name, d in m["drafts"].items():
            sources = "; ".join(f"{s} {tau_text(f)}" for s, f in d["by_source"].items())
            lines.append(f"  {name:<{wide}}  tau {tau_text(d)}  ({sources}){'  ' + d['note'] if 'note' in d else ''}")
        for pair, diff in m["differences"].items():
            lines.append(f"  tau({pair.replace(' - ', ') - tau(')}) = {number(diff['difference'], '+.3f')} "
                         f"{span(diff['difference_95'], '+.3f')}: {verdict(diff['difference_95'])}")
        for name, points in m["by_step"].items():
            lines.append(f"  {name} by step: " + ", ".join(f"{p['step']}: {tau_text(p)}" for p in points))
    lines.append("cost:")
    for name, c in figures["cost"].items():
        seconds = ", ".join(f"{kind} {s:.0f} s" for kind, s in c["seconds"].items() if s is not None)
        loss = f", last loss {c['loss']:.3f}" if c["loss"] is not None else ""
        lines.append(f"  {name}: {c['rows']} rows, {c['generated_tokens']} tokens answered; {c['steps']} steps{loss}; "
                     f"{seconds}")
    run = figures.get("this_run")
    if run:
        own = run["seconds"] - run["stages_seconds"]
        lines.append(f"this run: {run['seconds']:.0f} s, of which its stages' jobs {run['stages_seconds']:.0f} s: the "
                     f"pilot's own {own:.0f} s ({own / run['seconds']:.1%})")
    checked = {n: v for n, v in figures["lossless"].items() if v}
    if checked:
        lines.append("lossless (greedy): " + ", ".join(f"{n} {v['equal']}/{v['of']}" for n, v in checked.items()))
    return "\n".join(lines)


def tau_text(f: dict) -> str:
    return f"{number(f['tau'], '.3f')} {span(f['tau_95'], '.3f')}"


def verdict(interval: list[float] | None) -> str:
    """What a paired difference's interval says: an interval that holds 0 is no difference."""
    if interval is None:
        return "nothing to compare"
    return "no difference" if interval[0] <= 0 <= interval[1] else "higher" if interval[0] > 0 else "lower"


def plot(figures: dict, path: Path) -> None:
    """report.png: tau per recipe with its interval (one panel per temperature) and tau by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = list(figures["tau"])
    fig, axes = plt.subplots(1, len(temperatures) + 1, figsize=(5 * (len(temperatures) + 1), 4), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        drafts = {n: d for n, d in figures["tau"][temperature]["drafts"].items() if d["tau"] is not None}
        names = list(drafts)
        taus = [drafts[n]["tau"] for n in names]
        errors = np.array([[t - drafts[n]["tau_95"][0], drafts[n]["tau_95"][1] - t] for n, t in zip(names, taus)]).T
        ax.bar(range(len(names)), taus, yerr=errors if names else None, capsize=4)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set(ylabel="tau (tokens per target step)", title=f"tau by recipe, temperature {temperature}",
               ylim=(1, max(taus + [1.1]) * 1.05))
    steps_ax = axes[0][-1]
    for temperature in temperatures:
        for name, points in figures["tau"][temperature]["by_step"].items():
            points = [p for p in points if p["tau"] is not None]
            steps_ax.plot([p["step"] for p in points], [p["tau"] for p in points], marker="o",
                          label=f"{name}, T {temperature}")
    steps_ax.set(xlabel="training step", ylabel="tau", title="tau by training step")
    if steps_ax.get_legend_handles_labels()[0]:
        steps_ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write(figures: dict, root: Path) -> None:
    """report.json (strict JSON: no NaN) and report.png, each written aside and renamed."""
    tmp = root / ".report.json.tmp"
    tmp.write_text(json.dumps(finite(figures), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, root / "report.json")
    plot(figures, root / "report.png")


def finite(value):
    """The report with every NaN (a figure with nothing to measure) as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
