"""The entry points `ray job submit ... -- python -m ray_jobs.<name>` runs, each thin: its
arguments, then eagle_data. What they share: the --config and --set arguments, and the job
log's start."""

from __future__ import annotations

import argparse
import logging
import os


def job_arguments(prog: str, description: str, example: str) -> argparse.ArgumentParser:
    """A job's argument parser with --config (a YAML config) and --set (repeatable overrides)."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config key, e.g. --set {example} (repeatable)")
    return parser


def start_job_log() -> None:
    """The job log's format, and its first line: which copy of the project runs (under `ray
    job submit`, the working dir Ray unpacked)."""
    import eagle_data

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("eagle_data").info("code: eagle-data %s from %s", eagle_data.__version__,
                                         os.path.dirname(os.path.abspath(eagle_data.__file__)))
