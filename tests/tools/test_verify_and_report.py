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
