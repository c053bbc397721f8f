"""`python -m eagle_data inspect OUT [--sample-id ID | --n K]`: look at the data as a trainer
will see it. Without options: a one-screen summary of the whole OUT.

A sample shows its prompt turns, reasoning and response, token counts, finish reason, and
the token sequence decoded with the loss-mask boundary visible: in colour on a terminal
(trained-on tokens green, context grey), with [[loss: ... ]] markers when piped. Data text
is shown literally (tools/terminal.py): a row's escape sequences are shown, not obeyed.
"""

from __future__ import annotations

import argparse
import sys

import pyarrow.compute as pc
import pyarrow.dataset as pads

from eagle_data.errors import EagleDataError, NoSuchSample
from eagle_data.model_files import load_tokenizer
from eagle_data.storage.folder import Output
from eagle_data.storage.report import build_report
from eagle_data.storage.shards import readable_shards
from eagle_data.tools.terminal import literal

GREY, GREEN, BOLD, RESET = "\033[90m", "\033[32m", "\033[1m", "\033[0m"


def samples(out: Output, sample_id: str | None, n: int) -> list[dict]:
    files = readable_shards(out.fs, out.folder("data"), skip=True)  # a damaged one named and left out
    if not files:
        return []
    dataset = pads.dataset(files, filesystem=out.fs, format="parquet")
    if sample_id is not None:
        return dataset.to_table(filter=pc.field("sample_id") == sample_id).to_pylist()
    return dataset.head(n).to_pylist()


def not_found(out: Output, sample_id: str | None) -> str:
    """Why no sample was shown: the id is not there (and how many are), or nothing is."""
    files = readable_shards(out.fs, out.folder("data"), skip=True)
    held = pads.dataset(files, filesystem=out.fs, format="parquet").count_rows() if files else 0
    if held == 0:
        return f"{f'no sample {sample_id!r}: ' if sample_id else ''}{out.root}/data has no samples yet"
    return (f"no sample {sample_id!r} in {out.root}/data (it holds {held} samples; "
            f"`python -m eagle_data inspect {out.root} --n 3` shows the first ones)")


def mask_runs(input_ids: list[int], loss_mask: list[int]) -> list[tuple[int, list[int]]]:
    """Consecutive tokens with the same mask value: [(mask, ids), ...]."""
    runs: list[tuple[int, list[int]]] = []
    for token, m in zip(input_ids, loss_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return runs


def render_sample(row: dict, tokenizer, colour: bool) -> str:
    def heading(text):
        return f"{BOLD}{text}{RESET}" if colour else text

    def text(value):  # a prompt's or an answer's text: its lines kept
        return literal(value, multiline=True)

    mask = row["loss_mask"]
    lines = [
        heading(literal(f"sample {row['sample_id']}  source {row['source']}  finish_reason {row['finish_reason']}")),
        literal(f"variant {row['variant']}: " + ", ".join(f"{k} {v}" for k, v in row["sampling"].items())
                if row["sampling"] is not None else "answered by the dataset (its own answer: nothing sampled)"),
        f"tokens: prompt {row['num_prompt_tokens']}, reasoning {row['num_reasoning_tokens']}, "
        f"response {row['num_response_tokens']}; loss on {sum(mask)} of {len(mask)}",
        heading("--- prompt"),
        *(f"[{literal(m['role'])}] {text(m['content'])}" for m in row["messages"]),
        heading("--- reasoning"), text(row["reasoning"] or "(none)"),
        heading("--- response"), text(row["response"] or "(none)"),
    ]
    if tokenizer is not None:
        lines.append(heading("--- input_ids decoded; " + (
            "green = loss on, grey = context" if colour else "[[loss: ... ]] = loss on")))
        parts = []
        for m, ids in mask_runs(row["input_ids"], mask):
            decoded = text(tokenizer.decode(ids))
            if colour:
                parts.append(f"{GREEN if m else GREY}{decoded}{RESET}")
            else:
                parts.append(f"[[loss: {decoded} ]]" if m else decoded)
        lines.append("".join(parts))
    return "\n".join(lines)


def summary(out: Output) -> str:
    r = build_report(out)
    c, t = r["counts"], r["tokens"]
    lines = [
        f"OUT {literal(out.root)}",
        f"rows: selected {c['selected']} = prompts {c['prompts']} + skipped {c['skipped']}; "
        + (f"{c['conversations']} conversations; " if c["conversations"] != c["prompts"] else "")
        + f"ok {c['ok']}, failed attempts {c['failed_rows']} ({c['failed_final']} samples gave up)",
        "skipped: " + (", ".join(f"{literal(k)} {v}" for k, v in r["skipped_by_reason"].items()) or "none"),
        "finish reasons: " + (", ".join(f"{literal(k)} {v}" for k, v in r["finish_reasons"].items()) or "none"),
    ]
    for name in ("prompt", "reasoning", "response"):
        s = t[name]
        if s.get("count"):
            lines.append(f"{name:>9} tokens: mean {s['mean']}, p50 {s['p50']}, p95 {s['p95']}, "
                         f"max {s['max']}, total {s['total']}")
    lines.append(f"{'source':<45} {'prompts':>8} {'skipped':>8} {'ok':>8} {'failed':>7}")
    for source, counts in r["by_source"].items():
        lines.append(f"{literal(source)[:45]:<45} {counts.get('prompts', 0):>8} {counts.get('skipped', 0):>8} "
                     f"{counts.get('ok', 0):>8} {counts.get('failed', 0):>7}")
    if len(r["by_variant"]) > 1:
        lines.append(f"{'variant':<24} {'conversations':>13} {'ok':>8} {'failed':>7} {'stop':>6} {'length':>7} "
                     f"{'completion mean':>15} {'p95':>7}")
        for name, v in r["by_variant"].items():
            finish, done = v["finish_reasons"], v["completion_tokens"]
            lines.append(f"{literal(name)[:24]:<24} {v['conversations']:>13} {v['ok']:>8} {v['failed']:>7} "
                         f"{finish.get('stop', 0):>6} {finish.get('length', 0):>7} "
                         f"{done.get('mean', '-'):>15} {done.get('p95', '-'):>7}")
    return "\n".join(lines)


def inspect(path: str, sample_id: str | None = None, n: int | None = None,
            colour: bool | None = None) -> str:
    out = Output.existing(path)
    if sample_id is not None and not sample_id.strip():
        # Most likely an unset shell variable (--sample-id "$ID"): an error, not "show any".
        raise EagleDataError(f"--sample-id is empty ({sample_id!r}): give a sample id, or --n K for the first K samples")
    if n is not None and n < 1:
        raise EagleDataError(f"--n must be at least 1 (got {n}): the number of samples to show")
    if sample_id is None and n is None:
        return summary(out)
    rows = samples(out, sample_id, n or 1)
    if not rows:
        raise NoSuchSample(not_found(out, sample_id))
    colour = sys.stdout.isatty() if colour is None else colour
    try:
        tokenizer = load_tokenizer(out.manifest.tokenizer["path"], out.manifest.trust_remote_code)
    except Exception as e:  # the text fields still tell most of the story
        print(f"(token view off: cannot load the tokenizer: {e})", file=sys.stderr)
        tokenizer = None
    return "\n\n".join(render_sample(row, tokenizer, colour) for row in rows)


def add_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("inspect", help="a summary of OUT, or samples with their loss mask")
    p.add_argument("out")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--sample-id")
    which.add_argument("--n", type=int, help="show the first N samples")
    p.set_defaults(run=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    print(inspect(args.out, args.sample_id, args.n))
    return 0
