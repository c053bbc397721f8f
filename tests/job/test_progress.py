"""job/progress.py: the progress line's counts and the engine part, without Ray."""

from __future__ import annotations

import pyarrow as pa

from eagle_data.job import progress as progress_module
from eagle_data.job.progress import EngineWatch, Progress


class Written:
    def __init__(self, n: int):
        self.written = n


def ok_rows(reasoning: list[int], response: list[int], finish: list[str]) -> pa.Table:
    return pa.table({"num_reasoning_tokens": pa.array(reasoning, pa.int32()),
                     "num_response_tokens": pa.array(response, pa.int32()), "finish_reason": finish})


def test_the_line_counts_published_rows_and_completion_lengths():
    p = Progress(total=10, done_before=4, todo=6, max_tokens=16, every_s=60,
                 data_writer=Written(3), failed_writer=Written(1))
    p.update(ok_rows([2, 0, 0], [6, 10, 16], ["stop", "stop", "length"]))
    line = p.line()
    assert line.startswith("progress: 8/10 done (80.0%) | this run ok 3 failed 1 |")
    assert "completion tokens mean 11 p95 16" in line and "length-finished 33.3%" in line


def test_the_engine_part_says_loading_then_rows_in_the_engine(monkeypatch):
    pools = iter([None, {"running": 0, "starting": 2, "restarting": 0, "rows_in_engine": 0},
                  {"running": 1, "starting": 0, "restarting": 1, "rows_in_engine": 12}])
    monkeypatch.setattr(progress_module, "engine_pool", lambda names: next(pools))
    monkeypatch.setattr(progress_module, "engine_stats", lambda: [
        {"generated_tokens": 100, "running": 3, "waiting": 1, "time": 0}])
    watch = EngineWatch(("VLLMEngine",))
    watch.poll()
    assert watch.line() == "engine: not started"
    watch.poll()
    assert watch.line().startswith("engine: 2 replica(s) loading the model (0h00m00s), 0 replica(s) up")
    watch.poll()
    engine_line = watch.line()
    assert "1 replica(s) restarting, 1 replica(s) up, 12 rows in the engine" in engine_line
    assert "vLLM 3 running 1 waiting" in engine_line
    assert len(watch.load_s) == 1  # the loading spell ended when no replica was starting
