"""A data/ shard deleted from an OUT after its run (issue 55, case 10): every consumer of
data/ refuses the OUT, naming it, the counts and `verify`, instead of serving the rows left
(the stream trained on 6 of 8 rows without a word). On a copy of the session's real OUT
(`small_out`: 20 ok rows in shards of 4); no engine."""

from __future__ import annotations

import json
import shutil

import pytest

from support import SMALL_OUT_LOGPROBS, job_config, synthetic_row, write_out
from eagle_data.errors import MissingInput
from eagle_data.reader import OutReader, OutDataset, Samples


@pytest.fixture
def copied(small_out, tmp_path):
    return shutil.copytree(small_out, tmp_path / "out")


def test_a_deleted_data_shard_is_refused_by_the_reader_the_stream_and_the_tools(copied, tiny_qwen3, capsys):
    from eagle_data.__main__ import main
    from eagle_data.training.stream import features

    recorded = json.loads((copied / "manifest.json").read_text())["phases"]["generate"]["counts"]["ok"]
    shards = sorted((copied / "data").glob("*.parquet"))
    assert len(OutReader(str(copied)).files) == len(shards) > 1  # the whole OUT reads
    lost = len(__import__("pyarrow.parquet").parquet.read_table(shards[0]))
    shards[0].unlink()
    left = recorded - lost
    said = (f"{copied}/data holds {left} rows, fewer than the {recorded} ok rows the generate phase recorded")
    for read in (lambda: OutReader(str(copied)), lambda: Samples(str(copied)), lambda: OutDataset(str(copied)),
                 lambda: features(str(copied), job_config(copied, tiny_qwen3))):
        with pytest.raises(MissingInput) as caught:
            read()
        assert said in str(caught.value) and f"python -m eagle_data verify {copied}" in str(caught.value)
    # The tools that read data/ through the reader: one line, exit 2
    assert main(["export", str(copied), str(copied.parent / "x.jsonl"), "--format", "jsonl"]) == 2
    assert main(["vocab", str(copied), "--draft-vocab-size", "8", "--dest", str(copied.parent / "vocab")]) == 2
    for err in capsys.readouterr().err.strip().splitlines():
        assert err.startswith("error: ") and said in err, err
    # verify names what is missing, as before
    assert main(["verify", str(copied)]) == 1


def test_the_hidden_states_phase_refuses_an_out_missing_data_rows(copied, tiny_qwen3, ray_local):
    """The job's own consumer of data/: `--phase hidden_states` would give the rows left their
    states and leave the others out; refused before its run is recorded."""
    from eagle_data.job.phases.run import run

    sorted((copied / "data").glob("*.parquet"))[-1].unlink()
    cfg = job_config(copied, tiny_qwen3, engine__batch_size=4, sampling__max_tokens=12, source__sample=20,
                     output__rows_per_shard=4, sampling__logprobs=SMALL_OUT_LOGPROBS)
    with pytest.raises(MissingInput, match="rows, fewer than the [0-9]+ ok rows the generate phase recorded.*--phase generate"):
        run(cfg, phase="hidden_states")
    assert "hidden_states" not in json.loads((copied / "manifest.json").read_text())["phases"]


def test_more_rows_than_recorded_and_an_out_without_counts_are_read(copied, tmp_path):
    """A generate run adding rows (one still running) has more rows than the last finished run
    recorded; a synthetic OUT (tests/support.py write_out) records no count."""
    manifest = json.loads((copied / "manifest.json").read_text())
    generate = manifest["phases"]["generate"]
    generate["counts"]["ok"] -= 4
    generate["status"] = "running"
    (copied / "manifest.json").write_text(json.dumps(manifest))
    assert len(Samples(str(copied), shuffle=False)) == generate["counts"]["ok"] + 4
    synthetic = write_out(tmp_path / "synthetic", [synthetic_row(i, 3, 0, 2, "stop", "s") for i in range(4)], 2)
    (synthetic / "data" / "part-00000.parquet").unlink()
    assert len(Samples(str(synthetic))) == 2
