"""Progress line, report and inspect, checked against the rows on disk of real small runs."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from support import REPO, answered, job_config
from eagle_data.tools.inspect_out import render_sample
from eagle_data.model_files import load_tokenizer, special_tokens
from eagle_data.job.phases.run import run
from eagle_data.job.stages.postprocess import Postprocessor

PROGRESS = re.compile(
    r"progress: (\d+)/(\d+) done .* this run ok (\d+) failed (\d+) .* completion tokens mean (\d+) "
    r"p95 (\d+) \| length-finished ([\d.]+)%")


def table(folder):
    files = sorted(folder.glob("*.parquet"))
    return pads.dataset(files).to_table() if files else None


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def finished_out(ray_local, tmp_path_factory, tiny_qwen3):
    """An OUT made by two generate runs, with one prompt the engine fails on (so that the
    second run has earlier work to count and one sample to retry); the progress lines of
    each run, and the data/failed tables after it."""
    out = tmp_path_factory.mktemp("obs") / "out"
    cfg = job_config(out, tiny_qwen3, engine__batch_size=4, sampling__max_tokens=10, source__sample=24,
                     output__rows_per_shard=5, output__log_every_s=0.2)
    run(cfg, phase="prompts")
    shard = sorted((out / "prompts").glob("*.parquet"))[0]
    prompts = pq.read_table(shard).to_pylist()
    prompts[0]["tokenized_prompt"] = prompts[0]["tokenized_prompt"] + [10**7]
    pq.write_table(pa.Table.from_pylist(prompts, schema=pq.read_schema(shard)), shard)
    runs = []
    logger = logging.getLogger("eagle_data")
    for _ in range(2):
        handler, level = Lines(), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            run(cfg, phase="generate")
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        runs.append(([line for line in handler.lines if line.startswith("progress:")],
                     table(out / "data"), table(out / "failed")))
    return out, runs


def test_progress_line_counts_are_the_rows_on_disk(finished_out):
    out, runs = finished_out
    manifest = json.loads((out / "manifest.json").read_text())
    for attempt, (lines, data, failed_rows) in enumerate(runs, 1):
        assert lines, "no progress line"
        done, total, ok, failed, mean, p95, length_pct = map(float, PROGRESS.search(lines[-1]).groups())
        assert total == manifest["phases"]["prompts"]["counts"]["prompts"]
        if attempt == 1:
            assert (ok, failed) == (data.num_rows, 1) and done == data.num_rows + 1
            # The first run wrote every data row: its statistics are those of data/.
            completion = (np.array(data.column("num_reasoning_tokens")) +
                          np.array(data.column("num_response_tokens")))
            assert abs(mean - completion.mean()) <= 0.5
            assert p95 == np.sort(completion)[int(np.ceil(0.95 * len(completion))) - 1]
            share = 100 * np.mean(np.array(data.column("finish_reason")) == "length")
            assert abs(length_pct - share) < 0.05
        else:
            # Earlier runs' ok rows are counted as done; this run retried one sample.
            assert (ok, failed) == (0, 1) and done == total == data.num_rows + 1
            assert failed_rows.num_rows == 2


def test_report_matches_a_recount_of_the_shards(finished_out):
    out, _ = finished_out
    subprocess.run([sys.executable, "-m", "eagle_data", "report", str(out)], cwd=REPO, check=True,
                   capture_output=True)
    report = json.loads((out / "report.json").read_text())
    data, skipped, prompts = table(out / "data"), table(out / "skipped"), table(out / "prompts")
    failed = table(out / "failed")
    c = report["counts"]
    assert (c["ok"], c["prompts"], c["skipped"]) == (data.num_rows, prompts.num_rows, skipped.num_rows)
    assert c["selected"] == prompts.num_rows + skipped.num_rows
    assert c["failed_rows"] == failed.num_rows == 2
    finish = data.column("finish_reason").to_pylist()
    assert report["finish_reasons"] == {k: finish.count(k) for k in set(finish)}
    reasons = skipped.column("reason").to_pylist()
    assert report["skipped_by_reason"] == {k: reasons.count(k) for k in set(reasons)}
    response = np.array(data.column("num_response_tokens"))
    assert report["tokens"]["response"]["total"] == response.sum()
    assert report["tokens"]["response"]["max"] == response.max()
    sources = data.column("source").to_pylist()
    assert {s: v.get("ok", 0) for s, v in report["by_source"].items() if v.get("ok")} == \
        {s: sources.count(s) for s in set(sources)}
    assert report["throughput"][-1]["rows"] == data.num_rows
    assert [r["status"] for r in report["runs"]["generate"]] == ["complete"] * len(report["runs"]["generate"])
    for name in ("lengths.png", "finish_and_skips.png", "throughput.png"):
        png = (out / "report" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3


def test_inspect_shows_a_known_sample(finished_out):
    out, _ = finished_out
    row = table(out / "data").slice(0, 1).to_pylist()[0]
    shown = subprocess.run([sys.executable, "-m", "eagle_data", "inspect", str(out),
                            "--sample-id", row["sample_id"]], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout
    assert row["messages"][-1]["content"] in shown
    assert row["response"] in shown
    assert f"finish_reason {row['finish_reason']}" in shown
    assert "[[loss: " in shown and "\033[" not in shown  # piped: plain markers, no colour
    summary = subprocess.run([sys.executable, "-m", "eagle_data", "inspect", str(out)], cwd=REPO,
                             check=True, capture_output=True, text=True).stdout
    assert f"ok {table(out / 'data').num_rows}" in summary
    missing = subprocess.run([sys.executable, "-m", "eagle_data", "inspect", str(out), "--sample-id", "nope"],
                             cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and "error: no sample 'nope'" in missing.stderr


def test_render_marks_the_loss_boundary_of_reasoning(qwen3_tokenizer_dir):
    tokenizer = load_tokenizer(str(qwen3_tokenizer_dir))
    special = special_tokens(tokenizer, "<think>", "</think>")
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    gen = tokenizer.encode("<think>\nTwo and two.\n</think>\n\nIt is 4.", add_special_tokens=False)
    gen.append(tokenizer.eos_token_id)
    post = Postprocessor(str(qwen3_tokenizer_dir), False, special.eos_ids, special.reasoning_start_id,
                         special.reasoning_end_id, "response")
    [row] = post(pa.Table.from_pylist([{"sample_id": "k", "conversation_id": "k", "turn": 0,
                                        "source": "s", **answered("k"), "messages": messages,
                                        "prompt_token_ids": prompt, "generated_tokens": gen,
                                        "__inference_error__": ""}])).to_pylist()
    plain = render_sample(row, tokenizer, colour=False)
    assert "Two and two." in plain and "It is 4." in plain and "What is 2+2?" in plain
    # Under train_on=response the reasoning is context: the loss starts after </think>.
    assert "</think>[[loss: \n\nIt is 4.<|im_end|> ]]" in plain
    coloured = render_sample(row, tokenizer, colour=True)
    assert "\033[32m\n\nIt is 4.<|im_end|>\033[0m" in coloured
