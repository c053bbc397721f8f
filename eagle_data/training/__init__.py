"""The training side: what a training loop imports, and the draft-training Ray job.

    stream.py         the feature stream: `features(out, cfg)`, a Ray Dataset of samples with
                      the target's states at the EAGLE-3 layers, for a Ray Train job
    stream_gate.py    the stream's gate (its count and its bound on the bytes in flight) and
                      `stream_batches`, what a Ray Train worker takes the stream's rows with
    draft_config.py   `train.speculators` -> speculators' own TrainConfig, checked
    draft_trainer.py  the draft trainer's driver: vocabulary, the stream, Ray Train, the summary
    draft_loop.py     one Ray Train worker: speculators' draft, loss and optimizer over its shard
    checkpoints.py    the worker's step-<N>/ checkpoints: written, reported to Ray Train, restored
"""
