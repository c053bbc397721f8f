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
from pathlib import Path

import pytest
import torch

from support import STREAM_NAMESPACE, hidden_features, job_config, ray_processes, stream_into_trainer

pytestmark = pytest.mark.slow


def kill_the_engine_mid_stream(report: str, total: int, killed: list) -> None:
    """SIGKILL the engine replica's process once some rows, not all, have passed the checks."""
    from eagle_data.stream import stream_report

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not killed:
        pids = ray_processes("TransformersHiddenStates")
        try:
            ok = sum(e["ok"] for e in stream_report(report, STREAM_NAMESPACE)["epochs"].values())
        except ValueError:  # the report actor is not up yet
            ok = 0
        if pids and 4 <= ok < total:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(ok)
        time.sleep(0.02)


def test_epochs_into_a_torch_trainer_every_sample_once_per_epoch_equal_to_the_offline_phase_across_a_replica_kill(
        ray_local, hidden_out, deep_qwen3, tmp_path):
    from eagle_data.reader import OutReader

    epochs = 3
    cfg = job_config(hidden_out, deep_qwen3, engine__batch_size=2, hidden_states__dtype="float32")
    offline = hidden_features(hidden_out)
    killed = []
    killer = threading.Thread(target=kill_the_engine_mid_stream, args=("stream-test", epochs * len(offline), killed))
    killer.start()
    ranks, report = stream_into_trainer(ray_local, hidden_out, cfg, tmp_path, "stream-test", epochs=epochs,
                                        world_size=2, seed=7)
    killer.join()

    assert killed, "the engine replica was never killed mid-stream"
    print(f"killed the replica after {killed[0]} rows")
    assert [len(r) for r in ranks] == [epochs * len(offline) // 2] * 2  # 10 samples x 3 epochs, split equally
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
    assert report["epochs"] == {e: {"ok": len(offline), "failed": {}} for e in range(epochs)}
