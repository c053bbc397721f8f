"""An OUT made from a dataset's own answers (prompt.answers=dataset) is an OUT like any
other: the whole job on a real local Ray (prompts, generate without an engine, the
hidden-states phase on the transformers engine with the 8-layer tiny Qwen3), then every tool,
the reader and the feature stream take it. One OUT, made once; GSM8K-shaped rows read with
source.fields. (The ids and mask of each row against the chat template:
tests/job/test_dataset_answers.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from support import DATASET_ANSWERS_ROWS as ROWS, data_rows, dataset_answers_settings as settings, hidden_features, read
from eagle_data.__main__ import main
from eagle_data.errors import OutputMismatch
from eagle_data.job.phases.run import run
from eagle_data.storage.folder import Output

pytestmark = pytest.mark.slow

def test_an_out_of_the_datasets_answers_is_taken_by_every_tool_the_reader_and_the_stream(
        dataset_answers_out, deep_qwen3, tmp_path, capsys):
    out, dataset = dataset_answers_out
    manifest = Output.existing(str(out)).manifest
    # How the rows were made, in the manifest and in every data/ row; no engine was started.
    generate = manifest.phase("generate")
    assert generate["answered_by"] == "dataset" and generate["runs"][-1]["answered_by"] == "dataset"
    assert generate["runs"][-1]["engine_load_s"] == [] and "replica_nodes" not in generate["runs"][-1]
    assert generate["generate_config"]["prompt.answers"] == "dataset"
    assert manifest.counts("prompts")["skipped_by_reason"] == {"bad_schema": 1, "no_answer": 1}
    rows = data_rows(out)
    assert len(rows) == 7 and manifest.counts("generate")["ok"] == 7
    assert {r["answered_by"] for r in rows.values()} == {"dataset"} and {r["sampling"] for r in rows.values()} == {None}
    assert sorted(r["finish_reason"] for r in rows.values()) == ["length"] + ["stop"] * 6
    assert {r["source"] for r in rows.values()} == {"easy", "hard"}
    answers = {row["question"]: row["answer"] for row in ROWS[:7]}
    for r in rows.values():
        if r["finish_reason"] == "stop":
            assert r["response"] == answers[r["messages"][-1]["content"]]

    # The tools, as a user runs them.
    assert main(["verify", str(out)]) == 0
    assert main(["report", str(out)]) == 0
    assert main(["inspect", str(out), "--n", "2"]) == 0
    assert "answered by the dataset (its own answer: nothing sampled)" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["answered_by"] == "dataset" and report["counts"]["ok"] == 7
    assert "answered by the dataset" in (out / "report.html").read_text()
    for fmt in ("specforge", "speculators", "jsonl"):
        assert main(["export", str(out), str(tmp_path / f"{fmt}.jsonl"), "--format", fmt]) == 0
    exported = [json.loads(line) for line in (tmp_path / "jsonl.jsonl").read_text().splitlines()]
    assert {e["answered_by"] for e in exported} == {"dataset"} and len(exported) == 7
    assert len((tmp_path / "specforge.jsonl").read_text().splitlines()) == 6  # finished rows only
    assert main(["export", str(out), str(tmp_path / "offline"), "--format", "speculators-offline"]) == 0
    assert main(["vocab", str(out), "--draft-vocab-size", "64", "--format", "all"]) == 0
    assert (out / "vocab" / "vocab_mapping.pt").is_file()
    capsys.readouterr()

    # The reader, with the hidden-states phase's features.
    from eagle_data.reader import OutIterableDataset, OutReader, collate

    reader = OutReader(str(out))
    items = list(OutIterableDataset(reader, hidden_states=True, shuffle=False, columns=("sample_id",)))
    offline = hidden_features(out)
    assert len(items) == len(offline) == 7
    for item in items:
        row = rows[item["sample_id"]]
        assert item["input_ids"].tolist() == row["input_ids"] and item["loss_mask"].tolist() == row["loss_mask"]
        assert torch.equal(item["hidden_states"], offline[item["sample_id"]])
    assert collate(items[:3], reader.pad_id)["input_ids"].shape[0] == 3

    # The feature stream: the same features, computed by the engine replicas, no file written.
    from eagle_data.training.stream import features

    cfg = settings(out, deep_qwen3, dataset)
    streamed = features(str(out), cfg).take_all()
    assert sorted(s["sample_id"] for s in streamed) == sorted(rows)
    for s in streamed:
        assert list(s["input_ids"]) == rows[s["sample_id"]]["input_ids"]
        states = torch.frombuffer(bytearray(s["hidden_states"]), dtype=torch.float32).reshape(*s["hidden_states_shape"])
        assert torch.allclose(states, offline[s["sample_id"]], rtol=1e-4, atol=1e-5)

    # Rows made two ways never mix: the target's answers on this OUT are refused, naming the key.
    with pytest.raises(OutputMismatch, match=r"changed: prompt\.answers"):
        run(settings(out, deep_qwen3, dataset, prompt__answers="target"))
    assert len(read(out, "data")) == 7
