"""tools/verify.py and storage/report.py on synthetic OUT folders, without Ray."""

from __future__ import annotations

import pytest

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


def test_the_report_replaces_only_its_own_regular_files(tmp_path, capsys):
    """report.html a symlink (to the user's file): `report OUT` names it and exits 2, before
    any report file is replaced; the link and its file stay."""
    import os

    from eagle_data.__main__ import main

    out = write_out(tmp_path / "out", [synthetic_row(i, 4, 2, 3, "stop", "a") for i in range(3)], rows_per_shard=2)
    (tmp_path / "mine.html").write_text("the user's page")
    (out / "report.html").symlink_to(tmp_path / "mine.html")
    assert main(["report", str(out)]) == 2
    assert f"{out}/report.html is a symlink to {tmp_path / 'mine.html'}" in capsys.readouterr().err
    assert os.path.islink(out / "report.html") and (tmp_path / "mine.html").read_text() == "the user's page"
    assert not (out / "report.json").exists() and not (out / "report").exists()  # no half report
    (out / "report.html").unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "report.html").is_file() and (out / "report" / "lengths.png").is_file()


def test_text_in_the_plots_is_literal(tmp_path, capsys, monkeypatch):
    """A source named with `$...$` was parsed by matplotlib as math: `report OUT` raised
    ParseFatalException (and the job exited 1 after complete data). Every text in the plots
    is drawn as written: none is taken as mathtext, even `a$b$c`, which would parse."""
    import json

    import matplotlib.text

    import eagle_data.storage.report as report
    from eagle_data.__main__ import main

    drawn = []

    def png(fig, plt):
        texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_text()]
        drawn.extend((t.get_text(), t._preprocess_math(t.get_text())[1]) for t in texts)
        return save(fig, plt)

    save = report._png
    monkeypatch.setattr(report, "_png", png)
    sources = ["price $5 or $x^{$", r"$\notacommand$", "a$b$c"]
    rows = [synthetic_row(i, 4, 2, 3, "stop", sources[i % 3]) for i in range(6)]
    out = write_out(tmp_path / "out", rows, rows_per_shard=4)
    assert main(["report", str(out)]) == 0, capsys.readouterr().err
    assert {f"{s} (2)" for s in sources} <= {text for text, _ in drawn}  # the legend, as written
    assert [text for text, math in drawn if math] == []
    assert set(json.loads((out / "report.json").read_text())["by_source"]) == set(sources)
    assert (out / "report" / "lengths.png").stat().st_size > 0


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


def recorded_out(root):
    """A synthetic OUT of 3 data shards whose manifest records a vocab size and a hidden-states phase."""
    import json

    out = write_out(root, [synthetic_row(i, 4, 2, 3, "stop", "a") for i in range(6)], rows_per_shard=2)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["phases"]["generate"]["tokenizer"]["model_vocab_size"] = 1000
    manifest["phases"]["hidden_states"] = {"features": {"layer_ids": [1], "hidden_size": 8}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def damaged_out(tmp_path, damage: str):
    """A synthetic OUT (3 data shards) whose second shard is empty or cut to half; its
    manifest records a vocab size and a hidden-states phase (verify then reads data/'s
    lengths too)."""
    out = recorded_out(tmp_path / damage)
    victim = sorted((out / "data").glob("*.parquet"))[1]
    data = victim.read_bytes()
    victim.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    return out, victim


@pytest.mark.parametrize("damage", ["empty", "half"])
@pytest.mark.parametrize("tool", ["verify", "report", "export", "vocab", "inspect"])
def test_every_tool_names_a_damaged_data_shard_without_a_traceback(tmp_path, capsys, caplog, damage, tool):
    """Was: a pyarrow traceback from verify (with hidden states: data/'s lengths), report,
    export and vocab."""
    from eagle_data.__main__ import main

    out, victim = damaged_out(tmp_path, damage)
    argv = {"export": ["export", str(out), str(tmp_path / "x.jsonl"), "--format", "jsonl"],
            "vocab": ["vocab", str(out), "--draft-vocab-size", "10", "--dest", str(tmp_path / "v")]}.get(tool, [tool, str(out)])
    code = main(argv)
    printed = capsys.readouterr()
    assert victim.name in printed.out + printed.err + caplog.text
    assert "Traceback" not in printed.err
    assert code == {"verify": 1, "report": 0, "inspect": 0}.get(tool, 2), printed


@pytest.mark.parametrize("folder", ["data", "hidden_states"])
def test_a_file_name_that_is_not_utf8_is_named_by_every_tool_and_the_job(tmp_path, capsys, folder,
                                                                          qwen3_tokenizer_dir):
    """Not a name eagle-data writes, so not its file: was a UnicodeDecodeError traceback
    from every tool and from the job's start."""
    import os

    from support import job_config

    from eagle_data.__main__ import main
    from eagle_data.errors import ForeignFiles
    from eagle_data.job.phases.run import run

    out = recorded_out(tmp_path / "whole")
    (out / folder).mkdir(exist_ok=True)
    with open(os.fsencode(out / folder) + b"/part-\xff.parquet", "wb") as f:
        f.write(b"x")
    said = r"data/part-\xff.parquet".replace("data", folder)
    for argv in (["verify", str(out)], ["report", str(out)], ["inspect", str(out)],
                 ["export", str(out), str(tmp_path / "x.jsonl"), "--format", "jsonl"],
                 ["vocab", str(out), "--draft-vocab-size", "10", "--dest", str(tmp_path / "v")]):
        code, err = main(argv), capsys.readouterr().err
        if code == 0 and folder == "hidden_states" and argv[0] in ("report", "inspect", "export", "vocab"):
            continue  # a tool that does not read hidden_states/ of an OUT without that phase
        assert code == 2 and said in err and "not UTF-8" in err and "Traceback" not in err, (argv, err)
    with pytest.raises(ForeignFiles, match="not UTF-8") as e:
        run(job_config(out, qwen3_tokenizer_dir))
    assert said in str(e.value)
