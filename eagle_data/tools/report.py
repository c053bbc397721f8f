"""`python -m eagle_data report OUT`: (re)write OUT/report.json, report.html and report/*.png
from the shards. The report itself is storage/report.py's: each phase of the job writes it too."""

from __future__ import annotations

import argparse
import json

from eagle_data.storage.folder import Output
from eagle_data.storage.report import write_report
from eagle_data.tools.terminal import literal


def add_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="(re)write OUT/report.json and OUT/report.html from the shards")
    p.add_argument("out")
    p.set_defaults(run=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    report = write_report(Output.existing(args.out))
    print(json.dumps(report["counts"], sort_keys=True))
    print(f"wrote {literal(report['out'])}/report.json, report.html and report/*.png")
    return 0
