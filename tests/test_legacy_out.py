"""OUT folders written before the package layout changed (tests/data/out-before-layout/,
made by main at 10804e0 with a tiny random Qwen3, report files left out) are still read
by every tool and the reader."""

from __future__ import annotations

import shutil

import pytest

from conftest import REPO
from eagle_data.tools.export import export
from eagle_data.storage.folder import Output
from eagle_data.reader import Out, OutDataset
from eagle_data.tools.report import write_report
from eagle_data.tools.verify import verify

LEGACY = REPO / "tests" / "data" / "out-before-layout"


@pytest.fixture(params=["first_user", "all"])
def legacy_out(request, tmp_path):
    out = tmp_path / request.param
    shutil.copytree(LEGACY / request.param, out)
    return out


def test_verify_and_report_read_an_old_out(legacy_out):
    problems, counts = verify(str(legacy_out))
    assert problems == []
    assert counts["prompts"] == 6 and counts["ok"] == 6 and counts["generate_finished"]
    report = write_report(Output(str(legacy_out)))
    assert report["counts"]["ok"] == 6 and report["counts"]["selected"] == 6
    assert (legacy_out / "report.html").stat().st_size > 0


def test_reader_and_export_read_an_old_out(legacy_out, tmp_path):
    out = Out(str(legacy_out))
    assert out.pad_id == 151643
    rows = list(OutDataset(out))
    assert len(rows) == 6 and all(len(r["input_ids"]) == len(r["loss_mask"]) for r in rows)
    counts = export(str(legacy_out), str(tmp_path / "x.jsonl"), "speculators")
    assert counts["rows"] == 6
