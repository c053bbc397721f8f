"""Entry point for `ray job submit ... -- python -m ray_jobs.generate --config FILE`.

Connects to the Ray cluster when there is one (RAY_ADDRESS, set by `ray job submit`, or a
running local cluster) and starts a local Ray instance otherwise.
"""

from __future__ import annotations

from eagle_data.config import load_config
from eagle_data.errors import EmptyResult, cli, exit_with, stop_on_signals
from eagle_data.job.phases import PHASES
from eagle_data.job.phases.run import PHASE_CHOICES, run
from eagle_data.job.ray_session import ray_job
from ray_jobs import job_arguments, start_job_log


def main(argv: list[str] | None = None) -> int:
    parser = job_arguments("ray_jobs.generate", __doc__, "source.sample=100")
    parser.add_argument("--phase", choices=PHASE_CHOICES, default="all",
                        help="all = prompts, generate, and hidden_states when hidden_states.enabled")
    parser.add_argument("--fresh", action="store_true",
                        help="start over: with --phase all (default) delete everything the project wrote in "
                             "output.path; with --phase X delete X's rows and the later phases' (their "
                             "folders and manifest records), keeping the phases before X")
    parser.add_argument("--allow-empty", action="store_true",
                        help="exit 0 when the prompts phase leaves 0 prompts (empty dataset, every row "
                             "skipped) or the hidden-states phase selects 0 rows; otherwise that is an "
                             f"error, exit {EmptyResult.exit_code}")
    parser.add_argument("--keep-prompts", action="store_true",
                        help="go on with the finished prompts phase although source.dataset's files changed "
                             "since it read them (otherwise refused, naming what changed)")
    args = parser.parse_args(argv)
    start_job_log()
    out = None  # output.path once the config is read: what a full disk stopped writing

    def job() -> int:
        nonlocal out
        cfg = load_config(args.config, args.overrides)
        out = cfg.output.path
        # After a stop signal (errors.Stopped), Ctrl-C or an error the lock is released by now;
        # leaving Ray first prints the worker lines it still streams, so the error is the last line.
        with ray_job():
            result = run(cfg, phase=args.phase, fresh=args.fresh, allow_empty=args.allow_empty,
                         keep_prompts=args.keep_prompts)
        print(summary(out, result))
        return 0

    stop_on_signals()  # SIGTERM before Ray starts, too: the same exit as after
    return cli(job, writing=lambda: out, on_stop="; what was published is kept: run the same command to resume")


def summary(out: str, result: dict) -> str:
    lines = [f"OUT = {out}"]
    for phase in PHASES:
        if phase.name in result:
            lines += phase.summary(out, result[phase.name])
    times = [f"{name} {seconds:.0f}s" for name, seconds in result.get("seconds", {}).items()]
    lines.append(f"  time:     {', '.join(times)}")
    lines.append(f"  manifest: {out}/manifest.json")
    return "\n".join(lines)


if __name__ == "__main__":
    exit_with(main())
