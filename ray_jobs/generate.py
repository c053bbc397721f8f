"""Entry point for `ray job submit ... -- python -m ray_jobs.generate --config FILE`.

Connects to the Ray cluster when there is one (RAY_ADDRESS, set by `ray job submit`, or a
running local cluster) and starts a local Ray instance otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys

from eagle_data.config import ConfigError, load_config
from eagle_data.manifest import OutputMismatch
from eagle_data.pipeline import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_jobs.generate", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set source.sample=100 (repeatable)")
    parser.add_argument("--phase", choices=["prompts", "generate", "all"], default="all")
    parser.add_argument("--fresh", action="store_true",
                        help="delete everything in output.path first and start over")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        run(cfg, phase=args.phase, fresh=args.fresh)
    except (ConfigError, OutputMismatch, FileNotFoundError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
