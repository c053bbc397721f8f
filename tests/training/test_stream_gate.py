"""The feature stream's gate and failure path (eagle_data/training/stream_gate.py,
stream.py) and its selection, iterated by the test process on the session's Ray, without Ray
Train: the gate's counts (each place of an epoch's order once, with its reason), a stream whose stand-in
engine hands over bad rows, and drop_last / max_len. The stand-in engine answers each row
with states the test chooses (no model), on a synthetic OUT (tests/support.py write_out)."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
import ray
import ray.cloudpickle

from support import job_config, synthetic_row, write_out
from eagle_data.errors import ConfigError, MissingInput
from eagle_data.job.stages.engines.outputs import ENGINE_ERROR_COLUMN
from eagle_data.job.stages.engines.state_files import with_state_columns
from eagle_data.training.stream import features
from eagle_data.training.stream_gate import StreamGate, consumed_places, gate_summary, reasons

LAYERS, H = 8, 4  # the stand-in target: 8 decoder layers, hidden size 4 -> layer ids [2, 4, 5, 8]
LAYER_IDS = [2, 4, 5, 8]
# The synthetic OUT: 3 prompt tokens each, in file order (2 rows a shard), total lengths
LENGTHS = [5, 9, 6, 12, 4, 7, 10]
SAMPLES = [f"s{i:04d}" for i in range(len(LENGTHS))]
# The stand-in engine runs in Ray's workers, whose path has no tests/: its functions travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- the gate's count ---------------------------------------------------------------------

def test_the_gate_counts_each_place_once_with_its_latest_reason(ray_local):
    """A place of an epoch's order that passed once stays passed (a restarted stream computes
    it again); one that failed and then passed is no failure; one that failed twice is one
    failure, with the latest reason; the epochs count apart; `checked` counts every row."""
    gate = StreamGate.remote("gate-test", 4, 2, 3600.0)
    try:
        def add(ok, failed):
            ray_local.get(gate.add.remote(ok, failed))
            got = ray_local.get(gate.summary.remote())
            assert got.pop("figures")["rows_taken"] == 0  # no trainer took rows
            return got

        got = add([(0, 0), (0, 1)], [(0, 2, "s2", "check: a"), (0, 3, "s3", "check: a")])
        assert got == {"per_epoch": 4, "checked": 4, "failures": [(0, "s2", "check: a"), (0, "s3", "check: a")],
                       "epochs": {0: {"ok": 2, "failed": {"check: a": 2}}, 1: {"ok": 0, "failed": {}}}}
        got = add([(0, 2)], [(0, 0, "s0", "check: b")])  # s2 passed when computed again; s0 failed again
        assert got["epochs"][0] == {"ok": 3, "failed": {"check: a": 1}} and got["checked"] == 6
        assert got["failures"] == [(0, "s3", "check: a")]
        got = add([], [(0, 3, "s3", "EngineError: boom")])  # the same place fails again, another reason
        assert got["epochs"][0] == {"ok": 3, "failed": {"EngineError: boom": 1}}
        assert got["failures"] == [(0, "s3", "EngineError: boom")]
        got = add([(1, 0), (1, 1), (1, 3)], [(1, 2, "s1", "check: a")])
        assert got["epochs"] == {0: {"ok": 3, "failed": {"EngineError: boom": 1}},
                                 1: {"ok": 3, "failed": {"check: a": 1}}}
        assert got["failures"] == [(0, "s3", "EngineError: boom"), (1, "s1", "check: a")]
        assert got["checked"] == 11
    finally:
        ray_local.kill(gate)


def test_the_gate_logs_each_epoch_once_when_all_its_places_are_in(caplog):
    """The class behind the actor, in this process: its log lines."""
    gate = StreamGate.__ray_actor_class__("r", 3, 2, 0.0)  # every_s 0: a progress line at every add
    with caplog.at_level(logging.INFO, logger="eagle_data"):
        gate.add([(0, 0)], [(0, 1, "s1", "check: a")])
        assert "epoch 0 done" not in caplog.text
        assert caplog.messages[-1].startswith("stream r: 1/6 samples passed, 1 failed, ")
        gate.add([], [(0, 2, "s2", "check: b"), (1, 0, "s0", "check: a")])
        gate.add([(0, 1)], [])  # computed again: the epoch is logged once, not again
    done = [m for m in caplog.messages if "done" in m]
    assert done == ["stream r: epoch 0 done: 1 samples passed, 2 failed (1 x check: a; 1 x check: b)"]
    assert reasons(Counter({"check: b": 1, "check: a": 3})) == " (3 x check: a; 1 x check: b)"
    assert reasons(Counter()) == ""


# --- the gate's bound -----------------------------------------------------------------------------

def gate(limit: int, world_size: int = 2, chunk: int = 2, max_row_bytes: int = 10):
    """The class behind the actor, in this process, bounded to `limit` bytes."""
    return StreamGate.__ray_actor_class__("g", 8, 2, 3600.0, {"limit": limit, "world_size": world_size,
                                                                 "chunk": chunk, "replicas": 1,
                                                                 "max_row_bytes": max_row_bytes})


def test_the_gate_keeps_the_bytes_asked_and_not_taken_within_its_bound():
    """Two trainers joined (windows of (1 + 2) x 1 rows each: the floor is 6 + 2 x 2 x 2 = 14
    rows). A chunk is let through while the bytes in flight stay within the limit, or the rows
    within the floor; otherwise admit answers None (ask again) until rows are taken or fail a
    check, whose bytes leave the count then. Before a trainer joins there is no bound."""
    g = gate(limit=100)
    assert g.admit([(0, 0), (0, 1)], [60, 60], [6, 6], 0.0) == [False, False]  # no trainer yet: no bound
    g.taken(0, [(0, 0), (0, 1)], 12, 0.0, 0.0)
    assert g.inflight_bytes == 0
    assert g.join(0, "w0", 1, 1) == {"prefetch_batches": 1, "bound": 110}  # 3 + 8 rows x 10 bytes > 100
    assert g.join(1, "w1", 1, 1)["bound"] == 140
    assert g.floor_rows() == 14
    assert g.admit([(0, 2), (0, 3)], [50, 50], [5, 5], 0.0) == [False, False]
    # 100 + 50 > 100, but 3 rows <= the floor's 14: in (what the trainers' windows may hold)
    assert g.admit([(0, 4)], [50], [5], 0.0) == [False]
    g.floor_rows = lambda: 3  # as if the trainers' windows were smaller: the limit decides
    started = time.monotonic()
    assert g.admit([(0, 5)], [10], [1], 0.2) is None  # no room: None once the wait is over
    assert time.monotonic() - started >= 0.2
    g.add([(0, 2)], [(0, 3, "s3", "check: a")])  # a failed row frees its bytes; a passed one holds them
    assert (g.inflight_bytes, g.waiting) == (100, 1)
    answer = {}
    waiter = threading.Thread(target=lambda: answer.update(got=g.admit([(0, 5), (0, 6)], [30, 30], [3, 3], 10.0)))
    waiter.start()
    time.sleep(0.2)
    assert "got" not in answer  # waits for room: 100 + 60 > 100
    g.taken(1, [(0, 2), (0, 4)], 10, 0.5, 10.0)  # taken: 100 bytes leave; the waiting chunk is let through
    waiter.join(5)
    assert answer["got"] == [False, False] and g.inflight_bytes == 60
    figures = g.figures()
    assert figures["peak_bytes_in_flight"] == 150 and figures["rows_taken"] == 4
    assert figures["trainer_wait_share"] == 0.05 and figures["bytes_in_flight"] == 60


def test_a_new_trainer_group_starts_the_count_afresh_and_resumed_places_are_not_asked():
    """Ray Train started its workers again: the rows the lost execution had in flight leave
    the count (the new execution asks again). The places a restored trainer had trained on
    (stream_batches' `consumed`) are left out of every chunk after."""
    g = gate(limit=1000)
    g.join(0, "w0", 2, None)
    g.join(1, "w1", 2, None)
    g.admit([(0, 0), (0, 1)], [100, 100], [5, 5], 0.0)
    assert g.inflight_bytes == 200 and g.groups == 1
    g.join(1, "w1-again", 2, None)  # rank 1 joins with another worker: a new group
    assert (g.inflight_bytes, g.waiting, g.groups, list(g.consumers)) == (0, 0, 2, [1])
    g.resume(consumed_places([(0, 0), (0, 3), (1, 7)], 2, 8))
    assert g.admit([(0, 0), (0, 1)], [100, 100], [5, 5], 0.0) == [True, False]
    assert g.admit([(1, 6), (1, 7)], [100, 100], [5, 5], 0.0) == [False, True]
    assert g.inflight_bytes == 200 and sorted(g.inflight) == [(0, 1), (1, 6)]


def test_the_prefetch_stream_batches_takes_is_what_fits_half_the_limit():
    """Rows of up to 10 bytes, 2 trainers of batches of 4: the windows, 2 x (p + 2) x 4 rows,
    take at most half the limit: p = 4 with room, fewer with less, 1 at least."""
    assert gate(limit=10_000).join(0, "w", 4, None)["prefetch_batches"] == 4
    assert gate(limit=800).join(0, "w", 4, None)["prefetch_batches"] == 3  # 2 x 5 x 4 x 10 = 400
    assert gate(limit=10).join(0, "w", 4, None)["prefetch_batches"] == 1
    assert gate(limit=10).join(0, "w", 4, 6)["prefetch_batches"] == 6  # asked for: as asked


def test_the_summary_line_is_the_gates_counts_and_figures():
    """What the draft trainer's summary prints of its stream: one line from the gate's summary."""
    from eagle_data.training.stream_gate import summary_line

    g = gate(limit=2**20)
    g.join(0, "w0", 1, 1)
    g.admit([(0, 0), (0, 1)], [100, 100], [5, 5], 0.0)
    g.add([(0, 0)], [(0, 1, "s1", "check: a")])
    line = summary_line(g.summary())  # its speeds depend on the machine's: not asserted
    assert re.fullmatch(r"8 samples an epoch, 1 failed checks; [\d.]+ rows/s, \d+ tokens/s, peak 0\.0 MiB in flight "
                        r"\(bound 1\.0 MiB\), engines busy \d+%, trainers waited -; 1 trainer group \(more than 1: "
                        r"Ray Train started its workers again\)", line), line


# --- the stream, with a stand-in engine ----------------------------------------------------

@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """(OUT, config): the synthetic OUT and a config whose target is a config.json only."""
    root = tmp_path_factory.mktemp("stream-gate")
    rows = [synthetic_row(i, 3, 1, n - 4, "stop", "a") for i, n in enumerate(LENGTHS)]
    out = write_out(root / "out", rows, rows_per_shard=2)
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": LAYERS, "hidden_size": H}))
    return out, job_config(out, model, engine__batch_size=2, hidden_states__dtype="float32")


def states(sample_id: str, n: int) -> np.ndarray:
    """What the stand-in engine answers for a sample: [n, layers, H], no zero, from its id."""
    base = 1000 * int(sample_id[1:])
    return (base + 1 + np.arange(n * len(LAYER_IDS) * H, dtype=np.float32)).reshape(n, len(LAYER_IDS), H)


def stand_in_engine(bad: dict):
    """An engine stage that answers every row with `states`, except the (sample_id, epoch)
    keys of `bad`: "error" (an engine error), "short" (one token's states missing), "zeros"
    (layer id 4 all zeros), "tokens" (computed on other tokens)."""

    def answer(batch: pa.Table) -> pa.Table:
        rows = []
        for row in batch.to_pylist():
            how = bad.get((row["sample_id"], row["epoch"]))
            hidden, tokens = states(row["sample_id"], len(row["input_ids"])), list(row["input_ids"])
            if how == "short":
                hidden = hidden[:-1]
            elif how == "zeros":
                hidden[:, 1] = 0
            elif how == "tokens":
                tokens[0] += 1
            answered = {"hidden_states": hidden.tobytes(), "hidden_states_shape": list(hidden.shape),
                        "hidden_token_ids": tokens}
            rows.append({**row, ENGINE_ERROR_COLUMN: "EngineError: boom" if how == "error" else "",
                         **({} if how == "error" else answered)})
        return with_state_columns(pa.Table.from_pylist(rows))

    def stage(ds, cfg, layer_ids, dtype, scratch_dir):
        assert (layer_ids, dtype) == (LAYER_IDS, "float32")
        return ds.map_batches(answer, batch_format="pyarrow", num_cpus=0.25)

    return stage


def run_stream(cfg, out, name: str, bad: dict = {}, **stream_args) -> tuple[list[dict], dict]:
    """The stream's rows, iterated here, and its gate's summary once every place is counted."""
    ds = features(str(out), cfg, gate=name, shuffle=False, engine=stand_in_engine(bad), **stream_args)
    try:
        rows = ds.take_all()
        deadline = time.monotonic() + 60  # the checks' add calls may still be on their way
        while True:
            summary = gate_summary(name)
            counted = sum(e["ok"] + sum(e["failed"].values()) for e in summary["epochs"].values())
            if counted == summary["per_epoch"] * len(summary["epochs"]) or time.monotonic() > deadline:
                return rows, summary
            time.sleep(0.1)
    finally:
        ray.kill(ray.get_actor(name))


def per_epoch(rows: list[dict]) -> dict[int, Counter]:
    got = {}
    for row in rows:
        got.setdefault(int(row["epoch"]), Counter())[row["sample_id"]] += 1
    return got


@pytest.mark.slow
def test_rows_that_fail_a_check_never_reach_the_trainer_and_are_counted_with_their_reason(ray_local, synthetic):
    """Over 2 epochs the stand-in engine fails 2 rows of epoch 0 and 3 of epoch 1, each a
    way the phase's checks know: those rows are not in the stream, the others are, with the
    states the engine gave; the gate names each failure with its reason, per epoch."""
    out, cfg = synthetic
    bad = {("s0001", 0): "error", ("s0002", 0): "short", ("s0002", 1): "short", ("s0004", 1): "zeros",
           ("s0005", 1): "tokens"}
    rows, report = run_stream(cfg, out, "stream-gate-failures", bad, epochs=2)
    assert per_epoch(rows) == {0: Counter(dict.fromkeys(set(SAMPLES) - {"s0001", "s0002"}, 1)),
                               1: Counter(dict.fromkeys(set(SAMPLES) - {"s0002", "s0004", "s0005"}, 1))}
    for row in rows:  # a passing row's states reach the trainer as the engine handed them over
        n = len(row["input_ids"])
        assert list(row["hidden_states_shape"]) == [n, len(LAYER_IDS), H]
        assert row["hidden_states"] == states(row["sample_id"], n).tobytes()
        assert list(row["input_ids"]) == synthetic_row(int(row["sample_id"][1:]), 3, 1, n - 4, "stop", "a")["input_ids"]
    short = "check: hidden states have shape [{}, 4, 4], expected [{}, 4, 4] (tokens, layers, H)"
    zeros = "check: layer id(s) [4] are all zeros"
    tokens = "check: the engine's token_ids differ from the row's input_ids"
    assert report["per_epoch"] == len(SAMPLES)
    assert report["epochs"] == {
        0: {"ok": 5, "failed": {"EngineError: boom": 1, short.format(5, 6): 1}},
        1: {"ok": 4, "failed": {short.format(5, 6): 1, zeros: 1, tokens: 1}}}
    assert sorted(map(tuple, report["failures"])) == sorted([
        (0, "s0001", "EngineError: boom"), (0, "s0002", short.format(5, 6)), (1, "s0002", short.format(5, 6)),
        (1, "s0004", zeros), (1, "s0005", tokens)])
    assert report["checked"] == 2 * len(SAMPLES)


@pytest.mark.slow
def test_max_len_and_drop_last_select_the_rows_of_each_epoch(ray_local, synthetic):
    """max_len 9 keeps the rows of at most 9 tokens (s0000, s0001, s0002, s0004, s0005, in
    file order); over 2 ranks drop_last cuts the fifth, and padding repeats the first."""
    out, cfg = synthetic
    kept = [s for s, n in zip(SAMPLES, LENGTHS) if n <= 9]
    assert kept == ["s0000", "s0001", "s0002", "s0004", "s0005"]
    rows, report = run_stream(cfg, out, "stream-gate-drop-last", epochs=2, world_size=2, max_len=9,
                              drop_last=True)
    assert per_epoch(rows) == {e: Counter(dict.fromkeys(kept[:4], 1)) for e in (0, 1)}
    assert report["per_epoch"] == 4 and report["epochs"] == {e: {"ok": 4, "failed": {}} for e in (0, 1)}
    rows, report = run_stream(cfg, out, "stream-gate-padded", world_size=2, max_len=9)
    assert per_epoch(rows) == {0: Counter(kept) + Counter(kept[:1])}
    assert report["per_epoch"] == 6 and report["epochs"] == {0: {"ok": 6, "failed": {}}}


def test_a_stream_that_selects_nothing_or_gives_a_rank_nothing_is_refused(ray_local, synthetic):
    out, cfg = synthetic
    with pytest.raises(MissingInput, match="no data/ row is selected .* max_len 3"):
        features(str(out), cfg, max_len=3)
    with pytest.raises(ConfigError, match="drop_last=True with 1 samples .* world_size=2"):
        features(str(out), cfg, max_len=4, world_size=2, drop_last=True)
