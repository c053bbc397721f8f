"""Entry point for `ray job submit ... -- python -m ray_jobs.acceptance --config FILE`:
how many tokens per step of the target each draft of `acceptance.drafts` gets accepted,
under vLLM's EAGLE-3 speculative decoding, at each of acceptance.temperatures, on
output.path's prompts (eagle_data/evaluation/acceptance.py, docs/acceptance.md). Each
finished pass is kept in acceptance.path: the same command again goes on from there.

Connects to the Ray cluster when there is one (RAY_ADDRESS, set by `ray job submit`) and
starts a local Ray instance otherwise.
"""

from __future__ import annotations

from eagle_data.config import load_config
from eagle_data.errors import EmptyResult, cli, exit_with, stop_on_signals
from eagle_data.evaluation.acceptance import check, measure
from eagle_data.job.ray_session import ray_job
from ray_jobs import job_arguments, start_job_log


def main(argv: list[str] | None = None) -> int:
    parser = job_arguments("ray_jobs.acceptance", __doc__, "acceptance.num_speculative_tokens=5")
    # The prompts phase's flags, as the generate job takes them (its messages name them).
    parser.add_argument("--fresh", action="store_true",
                        help="start over: make output.path's prompts again (as the generate job's --fresh --phase "
                             "prompts: the later phases' rows in that OUT are deleted too) and measure every pass "
                             "again instead of reusing those kept in acceptance.path")
    parser.add_argument("--phase", choices=["prompts"], default="prompts",
                        help="the phase of output.path this job runs: the prompts phase only (accepted so that "
                             "`--fresh --phase prompts`, as the prompts phase's messages say, works here too)")
    parser.add_argument("--allow-empty", action="store_true",
                        help="exit 0 when the prompts phase leaves 0 prompts (nothing is measured, no report is "
                             f"written); otherwise that is an error, exit {EmptyResult.exit_code}")
    parser.add_argument("--keep-prompts", action="store_true",
                        help="go on with output.path's prompts although source.dataset's files changed since they "
                             "were made (otherwise refused, naming what changed)")
    args = parser.parse_args(argv)
    start_job_log()
    path = None  # acceptance.path once the config is read: what a full disk stopped writing

    def job() -> int:
        nonlocal path
        cfg = load_config(args.config, args.overrides)
        path = cfg.acceptance.path
        check(cfg)  # before Ray starts
        with ray_job():
            done = measure(cfg, fresh=args.fresh, keep_prompts=args.keep_prompts, allow_empty=args.allow_empty)
        if done is None:
            print(f"0 prompts in {cfg.output.path} (--allow-empty): nothing measured, no report written")
            return 0
        print(done[1])
        print(f"report: {path}/report.json, per_prompt.jsonl, acceptance.png")
        return 0

    stop_on_signals()  # SIGTERM before Ray starts, too: the same exit as after
    return cli(job, writing=lambda: path,
               on_stop="; the finished passes are kept in acceptance.path: run the same command to go on")


if __name__ == "__main__":
    exit_with(main())
