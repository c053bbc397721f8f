"""`inspect` (and the other tools' terminal lines) on synthetic OUT folders, without Ray:
data text is shown literally, and which sample was asked for is said as asked."""

from __future__ import annotations

import json
import re

import pytest

from support import synthetic_row, write_out
from eagle_data.__main__ import main
from eagle_data.errors import EagleDataError, NoSuchSample
from eagle_data.model_files import load_tokenizer
from eagle_data.tools.inspect_out import BOLD, GREEN, GREY, RESET, inspect
from eagle_data.tools.terminal import literal

# What a terminal acts on instead of showing: C0 (but \n and \t), DEL, C1; ESC is in C0.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# A row that sets the window title, clears the screen, moves back over a line, and CSI by C1.
HOSTILE = "title\x1b]0;pwned\x07 clear\x1b[2J\x1b[H back\rover c1\x9b31m del\x7f nul\x00"


def hostile_out(tmp_path, tokenizer_dir=None):
    """Data text with escape sequences in every field inspect shows; with a tokenizer, the
    first row's ids decode to such text too (the token view)."""
    rows = [synthetic_row(i, 2, 0, 2, "stop", f"src {HOSTILE}") for i in range(2)]
    rows[0].update(variant=f"v {HOSTILE}", reasoning=f"thinking\n{HOSTILE}", response=f"answer\n{HOSTILE}",
                   messages=[{"role": f"user {HOSTILE}", "content": f"line 1\n\tindented {HOSTILE}"}])
    if tokenizer_dir is not None:
        tokenizer = load_tokenizer(str(tokenizer_dir))
        prompt, gen = tokenizer.encode("prompt \x1b]0;x\x07"), tokenizer.encode(f"gen {HOSTILE}")
        rows[0].update(input_ids=prompt + gen, loss_mask=[0] * len(prompt) + [1] * len(gen),
                       num_prompt_tokens=len(prompt), num_response_tokens=len(gen))
    out = write_out(tmp_path / "out", rows, rows_per_shard=2)
    if tokenizer_dir is not None:
        manifest = json.loads((out / "manifest.json").read_text())
        manifest["phases"]["generate"]["tokenizer"]["path"] = str(tokenizer_dir)
        (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_literal_shows_every_control_character_and_keeps_readable_lines():
    assert literal("a\x1b[2Jb\x07\x9b\x7f\x00") == "a\\x1b[2Jb\\x07\\x9b\\x7f\\x00"
    assert literal("one\ntwo\tthree\r") == "one\\x0atwo\\x09three\\x0d"  # one line: nothing breaks it
    assert literal("one\ntwo\tthree\r", multiline=True) == "one\ntwo\tthree\\x0d"
    assert literal("ünïcode — 中文 \u2028 ok") == "ünïcode — 中文 \u2028 ok"  # printable text is untouched
    assert literal(None) == "None" and literal(7) == "7"


@pytest.mark.parametrize("colour", [False, True])
def test_inspect_prints_data_text_literally(tmp_path, qwen3_tokenizer_dir, colour):
    """The issue: a row could set the terminal's title or clear its screen through inspect."""
    out = hostile_out(tmp_path, qwen3_tokenizer_dir)
    for shown in (inspect(str(out), "s0000", colour=colour), inspect(str(out))):
        ours = shown
        for code in (BOLD, GREEN, GREY, RESET):  # inspect's own colours are the only escapes left
            ours = ours.replace(code, "")
        assert CONTROL.findall(ours) == [], shown
        assert "src title\\x1b]0;pwned\\x07 clear\\x1b[2J" in shown  # the summary's table too
    sample = inspect(str(out), "s0000", colour=colour)
    assert "\\x9b31m" in sample and "del\\x7f nul\\x00" in sample
    assert "answer\ntitle\\x1b]0;pwned" in sample and "line 1\n\tindented" in sample  # lines stay lines
    assert "back\\x0dover" in sample  # a carriage return cannot write over what was shown
    assert "gen title\\x1b]0;pwned\\x07" in sample  # the decoded tokens too
    assert re.search(r"sample s0000  source src title\\x1b\]0;pwned\\x07 .*\\x0dover", sample)
    assert "variant v title\\x1b" in sample and "[user title\\x1b" in sample


def test_verify_prints_problems_literally(tmp_path, capsys):
    rows = [synthetic_row(i, 2, 0, 2, "stop", "a") for i in range(2)]
    rows[1]["sample_id"] = rows[0]["sample_id"] = f"dup {HOSTILE}"
    assert main(["verify", str(write_out(tmp_path / "out", rows, rows_per_shard=1))]) == 1
    err = capsys.readouterr().err
    assert CONTROL.findall(err) == [] and "FAIL: sample_id dup title\\x1b]0;pwned" in err


def test_an_empty_or_unknown_sample_id_is_named(tmp_path, capsys):
    """The issue: `inspect --sample-id ""` said the OUT "has no samples yet" (it had 14). An
    empty id is most likely an unset shell variable: an error naming the option."""
    out = hostile_out(tmp_path)
    with pytest.raises(EagleDataError, match="--sample-id is empty"):
        inspect(str(out), "")
    assert main(["inspect", str(out), "--sample-id", ""]) == 2
    assert "error: --sample-id is empty" in capsys.readouterr().err
    with pytest.raises(NoSuchSample, match=f"no sample 'nope' in {out}/data \\(it holds 2 samples"):
        inspect(str(out), "nope")
    with pytest.raises(NoSuchSample, match="no sample 'x\\\\x1b\\[2J'"):  # the id, shown literally
        inspect(str(out), "x\x1b[2J")
    (out / "data" / "part-00000.parquet").unlink()
    with pytest.raises(NoSuchSample, match="has no samples yet"):
        inspect(str(out), n=1)
    with pytest.raises(NoSuchSample, match="no sample 's0000': .*has no samples yet"):
        inspect(str(out), "s0000")


@pytest.mark.parametrize("n", [-1, 0])
def test_a_count_below_one_is_an_error_naming_it(tmp_path, capsys, n):
    """`inspect --n -1` said "no sample None"; --n 0 showed one sample."""
    out = hostile_out(tmp_path)
    with pytest.raises(EagleDataError, match=f"--n must be at least 1 \\(got {n}\\)"):
        inspect(str(out), n=n)
    assert main(["inspect", str(out), "--n", str(n)]) == 2
    assert f"error: --n must be at least 1 (got {n})" in capsys.readouterr().err
