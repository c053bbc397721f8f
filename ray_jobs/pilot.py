"""Entry point for `ray job submit ... -- python -m ray_jobs.pilot --config FILE`: data
recipes compared on this target before the big run. Each recipe's generate job and draft,
then one acceptance job over every draft on held-out prompts, and one report
(eagle_data/evaluation/pilot.py, docs/pilot.md). Rerun the same command to resume.

Connects to the Ray cluster when there is one (RAY_ADDRESS, set by `ray job submit`) and
starts a local Ray instance otherwise; every stage's job joins it.
"""

from __future__ import annotations

import os
import time

from eagle_data.config import load_config
from eagle_data.errors import cli, exit_with, stop_on_signals
from eagle_data.evaluation.pilot import check_folder, run
from eagle_data.evaluation.pilot_stages import stages
from eagle_data.job.ray_session import ray_job, start_ray
from ray_jobs import job_arguments, start_job_log


def main(argv: list[str] | None = None) -> int:
    args = job_arguments("ray_jobs.pilot", __doc__, "pilot.path=/tmp/pilot").parse_args(argv)
    start_job_log()
    path = None  # pilot.path once the config is read: what a full disk stopped writing

    def job() -> int:
        nonlocal path
        started = time.monotonic()
        cfg = load_config(args.config, args.overrides)
        path = cfg.pilot.path
        stages(cfg)  # every recipe's config checked before Ray starts
        check_folder(cfg.pilot.path)
        import ray

        with ray_job():
            start_ray(cfg.output.ray_data_progress)
            env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
            figures = run(cfg, env, started)
        from eagle_data.evaluation.pilot_report import table

        print(table(figures))
        print(f"report: {path}/report.json, report.png")
        return 0

    stop_on_signals()  # SIGTERM before Ray starts, too: the same exit as after
    return cli(job, writing=lambda: path, on_stop="; finished stages are kept: run the same command to resume")


if __name__ == "__main__":
    exit_with(main())
