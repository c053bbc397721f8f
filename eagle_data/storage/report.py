"""OUT/report.json and OUT/report.html (+ OUT/report/*.png), computed from the shards alone.

Written at the end of each phase and by `python -m eagle_data report OUT`. Only small
columns are read (counts and lengths, never token lists).
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
from collections import Counter, defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from eagle_data.storage import manifest as mf
from eagle_data.storage.folder import Output
from eagle_data.storage.status import SampleStatus, current_entries
from eagle_data.storage.contract import PHASES, SCHEMAS, STAGING, VOCAB_SUMMARY
from eagle_data.storage.provenance import data_identity
from eagle_data.storage.files import check_replaceable, list_folder, read_json, write_bytes, write_json
from eagle_data.storage.shards import readable_shards

COLUMNS = {
    "prompts": ["sample_id", "source", "answer", "variant", "num_prompt_tokens"],
    "skipped": ["source", "reason"],
    "data": ["sample_id", "turn", "source", "variant", "num_prompt_tokens", "num_reasoning_tokens",
             "num_response_tokens", "finish_reason"],
    "failed": ["sample_id", "conversation_id", "source"],
    "stopped": ["sample_id", "reason"],
    "hidden_failed": ["sample_id", "error"],
}


def read_columns(out: Output, folder: str) -> pa.Table:
    files = readable_shards(out.fs, out.folder(folder), skip=True)  # a damaged one named and left out
    if not files:
        return pa.table({c: pa.array([], SCHEMAS[folder].field(c).type) for c in COLUMNS[folder]})
    return pads.dataset(files, filesystem=out.fs, format="parquet").to_table(columns=COLUMNS[folder])


def stats(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"count": 0}
    return {"count": int(values.size), "total": int(values.sum()), "mean": round(float(values.mean()), 1),
            "p50": int(np.percentile(values, 50)), "p95": int(np.percentile(values, 95)),
            "max": int(values.max())}


def throughput(out: Output, runs: list[dict]) -> list[dict]:
    """Cumulative ok rows and generated tokens at each data shard's publish time, starting
    from zero at the first generate run's start."""
    points = []
    if runs:
        start = datetime.datetime.fromisoformat(runs[0]["started_at"]).timestamp()
        points.append((start, 0, 0))
    for path in readable_shards(out.fs, out.folder("data"), skip=True):
        info = out.fs.get_file_info(path)
        table = pads.dataset(path, filesystem=out.fs, format="parquet").to_table(
            columns=["num_reasoning_tokens", "num_response_tokens"])
        tokens = int(np.sum(table.column(0).to_numpy()) + np.sum(table.column(1).to_numpy()))
        points.append((info.mtime.timestamp(), table.num_rows, tokens))
    points.sort()
    rows = np.cumsum([p[1] for p in points]).tolist()
    tokens = np.cumsum([p[2] for p in points]).tolist()
    return [{"time": t, "rows": r, "tokens": k} for (t, _, _), r, k in zip(points, rows, tokens)]


def hidden_states_section(out: Output) -> dict | None:
    """The hidden-states phase: samples and tokens published, bytes, failures by reason,
    and each run's throughput (prefill tokens/s) and storage estimate. None before it ran."""
    record = out.manifest.phase("hidden_states")
    if not record:
        return None
    entries = current_entries(out.fs, out.root)  # not those of tokens answered again since
    failed = read_columns(out, "hidden_failed")
    failed = failed.filter(pc.invert(pc.is_in(failed.column("sample_id"), pa.array(list(entries), pa.string()))))
    reasons = pc.utf8_slice_codeunits(failed.column("error"), 0, 60)  # the kind of failure, not its detail
    runs = [{k: r.get(k) for k in ("run_id", "status", "todo", "ok", "failed", "tokens", "bytes", "estimate_bytes",
                                   "wall_s")} for r in record.get("runs", [])]
    for r in runs:
        if r.get("tokens") and r.get("wall_s"):
            r["tokens_per_s"] = round(r["tokens"] / r["wall_s"], 1)
    return {
        "features": record.get("features", {}),
        "samples": len(entries),
        "tokens": sum(e.tokens for e in entries.values()),
        "bytes": sum(e.end - e.start for e in entries.values()),
        "failed_rows": failed.num_rows,
        "failed_by_reason": value_counts(reasons),
        "runs": runs,
    }


PHASE_SECTIONS = {"hidden_states": hidden_states_section}


def value_counts(column: pa.ChunkedArray) -> dict:
    """{value: rows}, the most common first (ties: first seen first), like Counter.most_common."""
    counts = pc.value_counts(column)  # in order of first appearance
    counts = counts.take(pc.array_sort_indices(counts.field("counts"), order="descending"))  # stable
    return dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()))


def by_variant(prompts: pa.Table, data: pa.Table, failed_samples: pa.Table) -> dict:
    """Per sampling variant: its conversations, ok rows, failed samples, finish reasons and
    lengths (job/variants.py; one variant, `default`, without sampling.variants)."""
    # The failed conversations' variants by a lookup in Arrow (a null where prompts/ lacks
    # one), not a Python dict of every conversation on the driver.
    at = pc.index_in(failed_samples.column("conversation_id_last"),
                     value_set=prompts.column("sample_id").combine_chunks())
    failed = Counter(prompts.column("variant").take(at).to_pylist())
    found = {}
    for name, conversations in sorted(value_counts(prompts.column("variant")).items()):
        rows = data.filter(pc.equal(data.column("variant"), name))
        lengths = {c: rows.column(f"num_{c}_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
                   for c in ("prompt", "reasoning", "response")}
        found[name] = {"conversations": conversations, "ok": rows.num_rows, "failed": failed.get(name, 0),
                       "finish_reasons": value_counts(rows.column("finish_reason")),
                       "completion_tokens": stats(lengths["reasoning"] + lengths["response"]),
                       **{f"{c}_tokens_mean": round(float(v.mean()), 1) if v.size else None
                          for c, v in lengths.items()}}
    return found


def build_report(out: Output) -> dict:
    manifest = out.manifest
    prompts, skipped = read_columns(out, "prompts"), read_columns(out, "skipped")
    data, failed = read_columns(out, "data"), read_columns(out, "failed")
    stopped = read_columns(out, "stopped")
    progress = SampleStatus.of(*(t.column("sample_id").to_pylist() for t in (data, failed, stopped)),
                               manifest.max_attempts)
    by_source: dict = defaultdict(Counter)
    first_answers = prompts.filter(pc.equal(prompts.column("answer"), 0))  # one row per prompt
    for name, table in (("prompts", first_answers), ("skipped", skipped), ("ok", data)):
        for source, n in value_counts(table.column("source")).items():
            by_source[source][name] = n
    # Failed samples that have no ok row (yet), once each.
    no_ok = failed.filter(pc.invert(pc.is_in(failed.column("sample_id"), value_set=data.column("sample_id"))))
    failed_samples = no_ok.group_by("sample_id", use_threads=False).aggregate(
        [("source", "last"), ("conversation_id", "last")])
    for source, n in value_counts(failed_samples.column("source_last")).items():
        by_source[source]["failed"] += n
    quotas = manifest.counts("prompts").get("sources", {})
    for source in set(by_source) | set(quotas):  # selected = prompts + skipped; per_source figures
        by_source[source]["selected"] = by_source[source]["prompts"] + by_source[source]["skipped"]
        by_source[source].update(quotas.get(source, {}))

    def col(name):
        return data.column(name).to_numpy(zero_copy_only=False).astype(np.int64)

    completion = col("num_reasoning_tokens") + col("num_response_tokens") if data.num_rows else np.empty(0)
    made_from = data_identity(out)
    return {
        "out": out.root,
        "generated_at": mf.now(),
        # Who wrote data/'s answers: the target (the engine), or the dataset itself (prompt.answers).
        "answered_by": manifest.phase("generate").get("answered_by", "target" if data.num_rows else None),
        "counts": {
            "selected": manifest.counts("prompts").get("selected"),
            "prompts": first_answers.num_rows,
            "conversations": prompts.num_rows,  # prompts x sampling.answers_per_prompt
            "skipped": skipped.num_rows,
            "ok": data.num_rows,
            "failed_rows": failed.num_rows,
            "failed_final": len(progress.given_up),
        },
        "skipped_by_reason": value_counts(skipped.column("reason")),
        "finish_reasons": value_counts(data.column("finish_reason")),
        "by_source": {s: dict(c) for s, c in sorted(by_source.items())},
        "by_variant": by_variant(prompts, data, failed_samples),
        # turns: all: ok rows per turn (0 = first user turn) and why conversations stopped early.
        "turns": {"ok_by_turn": value_counts(data.column("turn")),
                  "stopped_by_reason": value_counts(stopped.column("reason"))},
        "tokens": {
            "prompt": stats(col("num_prompt_tokens")) if data.num_rows else stats(
                prompts.column("num_prompt_tokens").to_numpy(zero_copy_only=False)),
            "reasoning": stats(col("num_reasoning_tokens")) if data.num_rows else stats(np.empty(0)),
            "response": stats(col("num_response_tokens")) if data.num_rows else stats(np.empty(0)),
            "completion": stats(completion),
        },
        "throughput": throughput(out, manifest.runs("generate")),
        # Written by `python -m eagle_data vocab OUT` (OUT/vocab/vocab.json): how many masked
        # tokens the top-D ids cover, to choose the draft vocabulary size D.
        **vocab_section(out, made_from),
        "made_from": made_from,  # the data this report was computed from
        # A phase that makes more than rows (features) has its own section.
        **{phase.name: section(out) for phase in PHASES if (section := PHASE_SECTIONS.get(phase.name))},
        # Each run's config stays in manifest.json.
        "runs": {phase.name: [{k: v for k, v in r.items() if k != "config"} for r in manifest.runs(phase.name)]
                 for phase in PHASES},
        "_lengths": {  # for the plots only; not written to report.json
            "data_source": data.column("source"), "completion": completion,
            "prompt": col("num_prompt_tokens") if data.num_rows else np.empty(0),
        },
    }


def vocab_section(out: Output, made_from: dict) -> dict:
    """vocab/vocab.json's summary, only when it was computed from the data/ there now: a
    vocabulary of other rows (a resumed run added some, a shard was quarantined) would show
    a coverage those rows do not have. Otherwise `vocab_stale` says why."""
    found = read_json(out.fs, f"{out.root}/{VOCAB_SUMMARY}")
    if found is None or found.get("made_from") == made_from:
        return {"vocab": found, "vocab_stale": None}
    return {"vocab": None, "vocab_stale": f"vocab/ was made from other data ({found.get('made_from')}; data/ now: "
                                          f"{made_from}): run `python -m eagle_data vocab {out.root}` again"}


def plots(report: dict) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    # Data text reaches the plots (source names in the legend): drawn as written, never
    # parsed as mathtext (a `$\x$` source raised ParseFatalException) or TeX, whatever the
    # user's matplotlibrc says.
    with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
        return _draw(report)


def _draw(report: dict) -> dict[str, bytes]:
    import matplotlib.pyplot as plt

    figures = {}
    lengths = report["_lengths"]

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    sources = sorted(lengths["data_source"].unique().to_pylist())
    for ax, key, title in ((axes[0], "completion", "completion tokens (reasoning + response)"),
                           (axes[1], "prompt", "prompt tokens")):
        values = np.asarray(lengths[key])
        for source in sources:
            mask = pc.equal(lengths["data_source"], source).to_numpy(zero_copy_only=False)
            if mask.any():
                ax.hist(values[mask], bins=30, histtype="step", linewidth=1.5, label=f"{source} ({mask.sum()})")
        ax.set_title(title)
        ax.set_xlabel("tokens")
        ax.set_ylabel("samples")
    if sources:
        axes[0].legend(fontsize=7)
    figures["lengths.png"] = _png(fig, plt)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    finish = report["finish_reasons"] or {"(no data)": 0}
    colours = {"stop": "tab:green", "length": "tab:orange"}
    axes[0].bar(list(finish), list(finish.values()), color=[colours.get(k, "tab:gray") for k in finish])
    axes[0].set_title("finish reasons (ok rows)")
    reasons = report["skipped_by_reason"] or {"(none)": 0}
    axes[1].barh(list(reasons), list(reasons.values()), color="tab:red")
    axes[1].set_title(f"skipped rows by reason ({report['counts']['skipped']})")
    fig.tight_layout()
    figures["finish_and_skips.png"] = _png(fig, plt)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    points = report["throughput"]
    if points:
        t0 = points[0]["time"]
        minutes = [(p["time"] - t0) / 60 for p in points]
        axes[0].step(minutes, [p["rows"] for p in points], where="post")
        # Shards arrive in bursts (a batch at a time): rate per time bin, not per shard gap.
        seconds = np.array([p["time"] - t0 for p in points])
        added = np.diff([0] + [p["tokens"] for p in points])
        n_bins = int(max(1, min(30, seconds[-1] // 10)))
        per_bin, edges = np.histogram(seconds, bins=n_bins, weights=added)
        width = max(edges[1] - edges[0], 1e-9)
        axes[1].step(edges[:-1] / 60, per_bin / width, where="post")
    axes[0].set_title("ok rows published (cumulative)")
    axes[0].set_xlabel("minutes since the first generate run started")
    axes[1].set_title("generated tokens/s (published, per time bin)")
    axes[1].set_xlabel("minutes since the first generate run started")
    figures["throughput.png"] = _png(fig, plt)

    if report["vocab"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        curve, chosen = report["vocab"]["coverage_curve"], report["vocab"]["draft_vocab_size"]
        ax.plot(curve["draft_vocab_size"], curve["coverage"], marker=".")
        ax.axvline(chosen, color="tab:red", linestyle="--", label=f"chosen D = {chosen}")
        ax.set_xscale("log")
        ax.set_xlabel("draft vocabulary size D (top-D target ids)")
        ax.set_ylabel("share of masked tokens covered")
        ax.set_title("draft vocabulary coverage")
        ax.legend()
        fig.tight_layout()
        figures["vocab_coverage.png"] = _png(fig, plt)
    return figures


def _png(fig, plt) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def to_html(report: dict, figures: dict[str, bytes]) -> str:
    def table(rows: dict, header: tuple) -> str:
        body = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(json.dumps(v))}</td></tr>"
                       for k, v in rows.items())
        return f"<table><tr><th>{header[0]}</th><th>{header[1]}</th></tr>{body}</table>"

    images = "".join(f'<h3>{name}</h3><img src="data:image/png;base64,{base64.b64encode(png).decode()}">'
                     for name, png in figures.items())
    return (
        "<!doctype html><meta charset=utf-8><title>eagle-data report</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:2px 8px}"
        "table{border-collapse:collapse;margin-bottom:1em}</style>"
        f"<h1>eagle-data report</h1><p>{html.escape(report['out'])} &middot; {report['generated_at']}"
        f"{' &middot; answered by the ' + html.escape(report['answered_by']) if report.get('answered_by') else ''}</p>"
        f"<h2>Counts</h2>{table(report['counts'], ('', 'rows'))}"
        f"<h2>Tokens</h2>{table(report['tokens'], ('', 'statistics'))}"
        f"<h2>By source</h2>{table(report['by_source'], ('source', 'rows'))}"
        f"<h2>By sampling variant</h2>{table(report['by_variant'], ('variant', 'rows and lengths'))}"
        f"<h2>Turns</h2>{table(report['turns'], ('', 'rows'))}"
        + "".join(f"<h2>{html.escape(name.replace('_', ' ').capitalize())}</h2>"
                  f"{table({k: v for k, v in report[name].items() if k != 'runs'}, ('', ''))}"
                  f"{table({r['run_id']: r for r in report[name]['runs']}, ('run', 'figures'))}"
                  for name in PHASE_SECTIONS if report.get(name))
        + (f"<h2>Draft vocabulary coverage</h2>{table(report['vocab']['coverage'], ('top D ids', 'share of masked tokens'))}"
           if report["vocab"] else "")
        + (f"<h2>Draft vocabulary coverage</h2><p>{html.escape(report['vocab_stale'])}</p>" if report["vocab_stale"] else "") +
        f"<h2>Plots</h2>{images}"
    )


def write_report(out: Output) -> dict:
    report = build_report(out)
    figures = plots(report)
    public = {k: v for k, v in report.items() if not k.startswith("_")}
    for name in ("report.json", *(f"report/{n}" for n in figures), "report.html"):
        check_replaceable(out.fs, f"{out.root}/{name}")  # one refused stops the report before its first file
    write_json(out.fs, f"{out.root}/report.json", public)
    # Each file whole or not at all: a failed write (a full disk) leaves the old one.
    staging = out.folder(STAGING)
    for name, png in figures.items():
        write_bytes(out.fs, f"{out.root}/report/{name}", png, staging)
    for found in list_folder(out.fs, f"{out.root}/report"):
        if found.is_file and found.base_name.endswith(".png") and found.base_name not in figures:
            out.fs.delete_file(found.path)  # a figure of what is no longer there (a stale vocab_coverage.png)
    write_bytes(out.fs, f"{out.root}/report.html", to_html(public, figures).encode(), staging)
    return public
