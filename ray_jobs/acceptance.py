"""Entry point for `ray job submit ... -- python -m ray_jobs.acceptance --config FILE`:
how many tokens per step of the target each draft of `acceptance.drafts` gets accepted,
under vLLM's EAGLE-3 speculative decoding, greedy, on output.path's prompts
(eagle_data/evaluation/acceptance.py, docs/acceptance.md).

Connects to the Ray cluster when there is one (RAY_ADDRESS, set by `ray job submit`) and
starts a local Ray instance otherwise.
"""

from __future__ import annotations

from eagle_data.config import load_config
from eagle_data.errors import cli, exit_with, stop_on_signals
from eagle_data.evaluation.acceptance import check, measure
from eagle_data.job.ray_session import ray_job
from ray_jobs import job_arguments, start_job_log


def main(argv: list[str] | None = None) -> int:
    args = job_arguments("ray_jobs.acceptance", __doc__, "acceptance.num_speculative_tokens=5").parse_args(argv)
    start_job_log()
    path = None  # acceptance.path once the config is read: what a full disk stopped writing

    def job() -> int:
        nonlocal path
        cfg = load_config(args.config, args.overrides)
        path = cfg.acceptance.path
        check(cfg)  # before Ray starts
        with ray_job():
            _, table = measure(cfg)
        print(table)
        print(f"report: {path}/report.json, per_prompt.jsonl, acceptance.png")
        return 0

    stop_on_signals()  # SIGTERM before Ray starts, too: the same exit as after
    return cli(job, writing=lambda: path)


if __name__ == "__main__":
    exit_with(main())
