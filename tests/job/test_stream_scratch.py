"""The feature stream's scratch folders on an engine's node (issue 55, case 8): each stream
makes `hidden_states.scratch_dir/eagle-data-stream-<id>/<run>/`; a killed stream's folder
stayed forever (a later stream cleaned only its own). Now every hidden-states engine that
starts removes the folders of streams that no longer run, never a running stream's (its
engines hold a lock while they live) and never a name the project does not make. The
streams' engines here are processes calling the engine actor's own `prepare`; no engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from support import REPO, job_config, synthetic_row, write_out
from eagle_data.job.stages.engines.state_files import prepare

HOLD = """
import sys, time
from eagle_data.job.stages.engines.state_files import prepare
prepare(sys.argv[1])
open(sys.argv[1] + "/row.safetensors", "w").write("a row's states, being written")
print("ready", flush=True)
time.sleep(600)
"""


def engine_process(run_folder: str) -> subprocess.Popen:
    """A stream's engine on this node: prepare(its run folder), a row's file in it, then alive."""
    engine = subprocess.Popen([sys.executable, "-c", HOLD, run_folder], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return engine


def stream_scratch(ray_local, tmp_path: Path, scratch: Path) -> str:
    """The run folder a real `features()` call hands its engine (its engine stage replaced by
    one that only records it)."""
    from eagle_data.training.stream import features

    out = write_out(tmp_path / f"out-{len(list(tmp_path.iterdir()))}",
                    [synthetic_row(i, 3, 0, 2, "stop", "s") for i in range(2)], 2)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8}))
    seen = []
    # The dataset dropped at once: its report actor, which no handle then holds, ends with it.
    features(str(out), job_config(out, model, hidden_states__scratch_dir=str(scratch)),
             engine=lambda ds, cfg, ids, dtype, folder: seen.append(folder) or ds)
    return seen[0]


def test_an_ended_streams_folder_is_removed_by_the_next_stream_and_a_running_ones_kept(ray_local, tmp_path):
    scratch = tmp_path / "scratch"
    running, killed, later = (stream_scratch(ray_local, tmp_path, scratch) for _ in range(3))
    assert len({Path(f).parent for f in (running, killed, later)}) == 3  # a folder per stream
    engines = [engine_process(running), engine_process(killed)]
    try:
        assert [e.stdout.readline().strip() for e in engines] == ["ready", "ready"]
        engines[1].send_signal(signal.SIGKILL)  # the killed stream's engine: nothing of it runs
        engines[1].wait()
        (scratch / "someone-else.txt").write_text("not ours")
        (scratch / "eagle-data-stream-notes").mkdir()

        prepare(later)  # the next stream's engine starts on the node

        assert not Path(killed).parent.exists()
        assert sorted(p.name for p in scratch.iterdir()) == sorted([
            Path(running).parent.name, Path(later).parent.name, "someone-else.txt", "eagle-data-stream-notes"])
        assert (Path(running) / "row.safetensors").is_file()  # the running stream's row, untouched
    finally:
        for engine in engines:
            engine.kill()
            engine.wait()
    # Its engine gone (however it ended), the running stream's folder goes with the next start.
    phase_run = scratch / "eagle-data-0123456789abcdef0123456789abcdef" / "20260101T000000-abcdef"
    prepare(str(phase_run))  # the hidden-states phase's engine cleans ended streams too
    assert not Path(running).parent.exists()
    assert Path(later).is_dir() and (scratch / "someone-else.txt").is_file()


def test_a_stream_folder_with_files_not_ours_is_left_and_an_unheld_one_removed(tmp_path):
    """A folder no engine holds is an ended stream's (one made before these locks too).
    Inside a stream's folder only run folders are removed; anything else keeps the folder."""
    scratch = tmp_path / "scratch"
    old = scratch / f"eagle-data-stream-{'a' * 32}" / "20260101T000000-abcdef"
    old.mkdir(parents=True)
    (old / "x.safetensors").write_bytes(b"left by a killed stream")
    kept = scratch / f"eagle-data-stream-{'b' * 32}"
    (kept / "20260101T000000-abcdef").mkdir(parents=True)
    (kept / "notes.txt").write_text("a user's")
    prepare(str(scratch / f"eagle-data-stream-{'c' * 32}" / "20260102T000000-abcdef"))
    assert not old.parent.exists()
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]
