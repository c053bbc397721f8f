"""tools/verify.py and storage/report.py on synthetic OUT folders, without Ray."""

from __future__ import annotations

from eagle_data.storage.folder import Output
from eagle_data.storage.report import build_report
from eagle_data.tools.verify import verify
from support import synthetic_row, write_out


def test_verify_names_a_duplicated_sample_and_what_is_missing(tmp_path):
    rows = [synthetic_row(i, 3, 1, 2, "stop", "s") for i in range(5)] + [synthetic_row(1, 3, 1, 2, "stop", "s")]
    problems, counts = verify(str(write_out(tmp_path / "out", rows, rows_per_shard=3)))
    assert "sample_id s0001 appears 2 times in data/ (exactly-once broken)" in problems
    assert any("not in prompts/" in p for p in problems)
    assert any("prompts phase has not finished" in p for p in problems)
    assert counts["ok"] == 5


def test_the_report_counts_rows_finishes_and_tokens_from_the_shards(tmp_path):
    rows = [synthetic_row(i, 4, 2, 3, "stop" if i % 3 else "length", "a" if i < 4 else "b") for i in range(6)]
    report = build_report(Output(str(write_out(tmp_path / "out", rows, rows_per_shard=4))))
    assert report["counts"]["ok"] == 6
    assert report["finish_reasons"] == {"length": 2, "stop": 4}
    assert set(report["by_source"]) == {"a", "b"}


def test_verify_checks_the_logprob_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_data.storage.contract import data_schema

    rows = [synthetic_row(i, 2, 1, 1, "stop", "s") for i in range(3)]
    for r in rows:
        r.update(top_logprob_ids=[[1, 2], [3, 4]], top_logprobs=[[-0.1, -0.2], [-0.3, -0.4]],
                 token_logprobs=[-0.1, -0.3])
    rows[1]["token_logprobs"] = [-0.1]  # one entry short
    rows[2]["top_logprob_ids"] = [[1, 2], [3, 1000]]  # the synthetic vocabulary has 1000 ids
    rows[2]["token_logprobs"] = [0.5, float("nan")]
    out = write_out(tmp_path / "out", rows, rows_per_shard=3)
    [shard] = (out / "data").glob("*.parquet")
    pq.write_table(pa.Table.from_pylist(rows, schema=data_schema(2).with_metadata(pq.read_schema(shard).metadata)), shard)
    problems, _ = verify(str(out))
    logprob_problems = [p for p in problems if "log" in p]
    assert len(logprob_problems) == 3, problems
    assert "sample_id s0001: its log-probabilities are not one entry per generated token" in logprob_problems[0]
    assert "top_logprob_ids outside the vocabulary [0, 1000): 1..1000" in logprob_problems[1]
    assert "token_logprobs holds values that are not finite" in logprob_problems[2]


def test_verify_names_a_shard_of_another_out(tmp_path):
    import pyarrow.parquet as pq

    from eagle_data.storage.contract import OUT_ID_KEY

    out = write_out(tmp_path / "out", [synthetic_row(i, 2, 1, 1, "stop", "s") for i in range(3)], rows_per_shard=3)
    assert not [p for p in verify(str(out))[0] if "shard" in p]
    other = write_out(tmp_path / "other", [synthetic_row(7, 2, 1, 1, "stop", "s")], rows_per_shard=3)
    table = pq.read_table(other / "data" / "part-00000.parquet")  # as another OUT's job wrote it
    table = table.replace_schema_metadata({**table.schema.metadata, OUT_ID_KEY.encode(): b"another"})
    pq.write_table(table, out / "data" / "part-00001.parquet")  # copied in
    foreign = [p for p in verify(str(out))[0] if "not this OUT's shard" in p]
    assert foreign == [f"{out}/data/part-00001.parquet: not this OUT's shard: written for another OUT "
                       "(out_id another; this OUT's is synthetic)"]
