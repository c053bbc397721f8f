"""The feature stream into a real Ray Train TorchTrainer with 2 CPU workers, on the OUT the
job made with hidden states (`hidden_out`: 8-layer tiny Qwen3, transformers engine, float32
states at layer ids [2, 4, 5, 8]): every sample once per epoch across the workers, the same
row count on each worker, and each sample's tensors equal to the offline phase's."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import pytest
import torch

from support import STREAM_NAMESPACE, hidden_features, job_config, ray_processes, stream_into_trainer

pytestmark = pytest.mark.slow


def checked(report: str) -> int:
    """Rows the stream's checks have seen, repeats included (0 before the report is up)."""
    from eagle_data.training.stream import stream_report

    try:
        return stream_report(report, STREAM_NAMESPACE)["checked"]
    except ValueError:  # the report actor is not up yet
        return 0


def kill_a_worker_then_the_engine(report: str, total: int, killed: dict, done: threading.Event) -> None:
    """SIGKILL a training worker once some rows, not all, have been checked; then, once the
    restarted stream's new engine replica has answered 4 rows, that replica's process."""
    while not done.is_set() and "engine" not in killed:
        rows = checked(report)
        replicas = set(ray_processes("TransformersHiddenStates"))
        if "worker" not in killed:
            workers = ray_processes("RayTrainWorker")
            if len(workers) == 2 and 4 <= rows < total:
                os.kill(workers[0], signal.SIGKILL)
                killed.update(worker=rows, replicas=replicas)
        elif replicas - killed["replicas"]:
            killed.setdefault("new_replica_at", rows)  # rows checked when the new replica was first seen
            if killed["new_replica_at"] + 4 <= rows < killed["new_replica_at"] + total - 4:
                os.kill(min(replicas - killed["replicas"]), signal.SIGKILL)
                killed["engine"] = rows - killed["new_replica_at"]
        time.sleep(0.02)


def test_epochs_into_a_torch_trainer_every_sample_once_per_epoch_equal_to_the_offline_phase_across_faults(
        ray_local, hidden_out, deep_qwen3, tmp_path):
    """A training worker SIGKILLed mid-stream: Ray Train (FailureConfig(max_failures=1))
    starts a new worker group, whose shards run the stream again from epoch 0 (a new
    execution, a new engine replica). Then that replica SIGKILLed mid-stream: Ray Data
    restarts it. The new group's workers still get every sample once per epoch. The stream
    bounded to 1 byte in flight, which the gate raises to what the trainers' windows and the
    equal split hold: it keeps to that bound, and the faults do not stop it."""
    from eagle_data.reader import OutReader

    epochs = 2
    cfg = job_config(hidden_out, deep_qwen3, engine__batch_size=2, hidden_states__dtype="float32",
                     stream__max_bytes_in_flight=1)
    offline = hidden_features(hidden_out)
    killed, done = {}, threading.Event()
    killer = threading.Thread(target=kill_a_worker_then_the_engine,
                              args=("stream-test", epochs * len(offline), killed, done))
    killer.start()
    try:
        ranks, report = stream_into_trainer(ray_local, hidden_out, cfg, tmp_path, "stream-test", max_failures=1,
                                            batch_size=1, epochs=epochs, world_size=2, seed=7)
    finally:
        done.set()
        killer.join()

    assert "worker" in killed, "no training worker was killed mid-stream"
    assert "engine" in killed, "the restarted stream's engine replica was never killed mid-stream"
    print(f"killed a training worker after {killed['worker']} rows checked, then the restarted stream's engine "
          f"replica after it had answered {killed['engine']}")
    assert [len(r) for r in ranks] == [epochs * len(offline) // 2] * 2  # 10 samples x 2 epochs, split equally
    for epoch in range(epochs):
        seen = Counter(item["sample_id"] for rank in ranks for item in rank if item["epoch"] == epoch)
        assert seen == Counter(dict.fromkeys(offline, 1))
    rows = {row["sample_id"]: row for row in OutReader(str(hidden_out)).dataset().to_table(
        columns=["sample_id", "input_ids", "loss_mask"]).to_pylist()}
    for item in (item for rank in ranks for item in rank):
        sid = item["sample_id"]
        assert item["input_ids"].tolist() == rows[sid]["input_ids"]
        assert item["loss_mask"].tolist() == rows[sid]["loss_mask"]
        assert torch.equal(item["hidden_states"], offline[sid]), sid  # bit-equal: same engine, same dtype
        assert item["padding_is_zero"]
    # Each place of each epoch's order counted once, though both attempts computed some.
    assert report["epochs"] == {e: {"ok": len(offline), "failed": {}} for e in range(epochs)}
    assert report["checked"] > epochs * len(offline), report["checked"]
    figures = report["figures"]
    print("stream figures:", figures)
    assert figures["trainer_groups"] == 2  # the lost group's and the new one
    assert figures["limit_bytes"] == 1 and figures["bound_bytes"] > 1
    assert 0 < figures["peak_bytes_in_flight"] <= figures["bound_bytes"]
    # The floor: 2 windows of (1 + 2) x 1 rows (prefetch 1: the most that fits), and 2 x 2 x 2 rows
    # for the equal split; less than the 20 rows streamed, so chunks were held back.
    assert figures["peak_rows_in_flight"] <= 14 and figures["held"] > 0
    assert figures["rows_taken"] >= epochs * len(offline)
