"""Entry point for `ray job submit ... -- python -m ray_jobs.train_draft --config FILE`:
train an EAGLE-3 draft from the feature stream with speculators' own draft model, vocab
mapping and loss (speculators 0.9.0, the optional `draft` extra;
eagle_data/training/draft_trainer.py, docs/streaming.md).

Connects to the Ray cluster when there is one (RAY_ADDRESS, set by `ray job submit`) and
starts a local Ray instance otherwise.
"""

from __future__ import annotations

from eagle_data.config import load_config
from eagle_data.errors import cli, exit_with, stop_on_signals
from eagle_data.feature_shape import feature_shape
from eagle_data.job.ray_session import ray_job
from eagle_data.training.draft_config import speculators_config
from eagle_data.training.draft_trainer import train
from ray_jobs import job_arguments, start_job_log


def main(argv: list[str] | None = None) -> int:
    args = job_arguments("ray_jobs.train_draft", __doc__, "train.workers=8").parse_args(argv)
    start_job_log()
    save_path = None  # trainer.save_path once the config is read: what a full disk stopped writing

    def job() -> int:
        nonlocal save_path
        cfg = load_config(args.config, args.overrides)
        shape = feature_shape(cfg)  # the target's config, read once for the run
        spec = speculators_config(cfg, shape)
        save_path = spec.trainer.save_path
        with ray_job():
            result = train(cfg, spec, shape)
        print(result)
        return 0

    stop_on_signals()  # SIGTERM before Ray starts, too: the same exit as after
    return cli(job, writing=lambda: save_path)


if __name__ == "__main__":
    exit_with(main())
