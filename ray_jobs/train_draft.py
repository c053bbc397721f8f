"""Entry point for `ray job submit ... -- python -m ray_jobs.train_draft --config FILE`:
train an EAGLE-3 draft from the feature stream with speculators' own draft model, vocab
mapping and loss (speculators 0.9.0, the optional `draft` extra;
eagle_data/training/draft_trainer.py, docs/streaming.md).

Connects to the Ray cluster when there is one (RAY_ADDRESS, set by `ray job submit`) and
starts a local Ray instance otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os

import eagle_data
from eagle_data.config import load_config
from eagle_data.errors import cli, exit_with, stop_on_signals
from eagle_data.job.ray_session import ray_job
from eagle_data.training.draft_config import speculators_config
from eagle_data.training.draft_trainer import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_jobs.train_draft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (configs/*.yaml) with a `train:` section")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.workers=8 (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("eagle_data").info("code: eagle-data %s from %s", eagle_data.__version__,
                                         os.path.dirname(os.path.abspath(eagle_data.__file__)))
    save_path = None  # trainer.save_path once the config is read: what a full disk stopped writing

    def job() -> int:
        nonlocal save_path
        cfg = load_config(args.config, args.overrides)
        spec = speculators_config(cfg)
        save_path = spec.trainer.save_path
        with ray_job():
            result = train(cfg, spec)
        print(result)
        return 0

    stop_on_signals()  # SIGTERM before Ray starts, too: the same exit as after
    return cli(job, writing=lambda: save_path)


if __name__ == "__main__":
    exit_with(main())
