"""The phases have one shape: the job's declarations, OUT's records of them, verify's checks
and the report agree on which phases there are, so adding one cannot leave a part behind."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from eagle_data.config import PHASE_NAMES, Config
from eagle_data.job.phases import PHASES
from eagle_data.job.phases.run import PHASE_CHOICES
from eagle_data.storage import contract
from eagle_data.storage.manifest import Manifest
from eagle_data.storage.report import PHASE_SECTIONS
from eagle_data.tools.verify import PHASE_CHECKS, SHARD_CHECKS


def test_every_phase_is_declared_recorded_and_checked_in_the_same_order():
    names = [p.name for p in PHASES]
    assert names == [p.name for p in contract.PHASES] == list(PHASE_NAMES)  # PHASE_NAMES: the config's tags
    assert PHASE_CHOICES == (*names, "all")
    assert list(PHASE_CHECKS) == names
    assert set(PHASE_SECTIONS) <= set(names)
    assert set(SHARD_CHECKS) <= set(contract.FOLDERS)
    owned = {f for p in contract.PHASES for f in p.folders}
    assert owned == {*contract.FOLDERS, contract.HIDDEN_STATES}  # every folder belongs to one phase
    for phase in PHASES:
        assert set(phase.reads) <= set(names[:names.index(phase.name)]), f"{phase.name} reads a later phase"


def test_all_runs_the_phases_that_are_enabled():
    cfg = Config.model_validate({"model": {"path": "m"}, "output": {"path": "o"}})
    assert [p.name for p in PHASES if p.in_all(cfg)] == ["prompts", "generate"]
    enabled = cfg.model_copy(update={"hidden_states": cfg.hidden_states.model_copy(update={"enabled": True})})
    assert [p.name for p in PHASES if p.in_all(enabled)] == ["prompts", "generate", "hidden_states"]


@pytest.mark.parametrize("phase", [p.name for p in contract.PHASES])
def test_the_manifest_checks_and_reads_every_phase_the_same_way(tmp_path, phase):
    manifest = Manifest(pafs.LocalFileSystem(), str(tmp_path))
    assert manifest.status(phase) is None and not manifest.finished(phase)
    run = manifest.start_run(phase, {}, {contract.PHASE_CONFIG[phase]: {"k": 1}})
    assert manifest.status(phase) == "running" and not manifest.finished(phase)
    manifest.check_config(phase, {"k": 1})
    with pytest.raises(Exception, match=rf"holds {phase} rows .* \(changed: k\)"):
        manifest.check_config(phase, {"k": 2})
    manifest.finish_run(phase, run, {"ok": 1})
    assert manifest.finished(phase) and manifest.counts(phase) == {"ok": 1}
    assert [r["status"] for r in manifest.runs(phase)] == ["complete"]
    manifest.mark(phase, "damaged")
    assert not manifest.finished(phase)


def test_a_record_written_before_phases_had_a_status_has_its_latest_runs(tmp_path):
    manifest = Manifest(pafs.LocalFileSystem(), str(tmp_path))
    manifest.data["phases"]["generate"] = {"runs": [{"status": "complete"}, {"status": "running"}]}
    assert manifest.status("generate") == "running" and not manifest.finished("generate")
    manifest.data["phases"]["generate"]["runs"].pop()
    assert manifest.finished("generate")
