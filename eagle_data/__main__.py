"""`python -m eagle_data COMMAND OUT ...`: tools that work on an OUT folder. A user error
prints `error: ...` and exits with its code (eagle_data.errors); `verify` exits 1 when it
finds a problem, a result rather than an error."""

from __future__ import annotations

import argparse
import json
import sys

from eagle_data.errors import cli, exit_with, stop_on_signals
from eagle_data.tools.terminal import literal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_data")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("verify", help="check the exactly-once and accounting invariants of OUT").add_argument("out")
    commands.add_parser("report", help="(re)write OUT/report.json and OUT/report.html from the shards").add_argument("out")
    look = commands.add_parser("inspect", help="a summary of OUT, or samples with their loss mask")
    look.add_argument("out")
    which = look.add_mutually_exclusive_group()
    which.add_argument("--sample-id")
    which.add_argument("--n", type=int, help="show the first N samples")
    from eagle_data.tools.export import add_cli as add_export
    from eagle_data.tools.vocab import add_cli as add_vocab

    add_export(commands)
    add_vocab(commands)
    args = parser.parse_args(argv)
    stop_on_signals()  # SIGTERM unwinds like Ctrl-C: a file half written aside is removed
    # What a command writes: export's and vocab's destination, else OUT (report, vocab).
    return cli(lambda: run_command(args), writing=lambda: getattr(args, "dest", None) or args.out)


def run_command(args: argparse.Namespace) -> int:
    if args.command == "verify":
        from eagle_data.tools.verify import verify

        problems, counts = verify(args.out)
        print(json.dumps(counts, sort_keys=True))
        for p in problems:  # they name sample ids and files: data text, shown literally
            print(f"FAIL: {literal(p)}", file=sys.stderr)
        if not problems:
            print(f"OK: {literal(args.out)} holds every invariant")
        return 1 if problems else 0
    if args.command == "report":
        from eagle_data.storage.folder import Output
        from eagle_data.storage.report import write_report

        report = write_report(Output.existing(args.out))
        print(json.dumps(report["counts"], sort_keys=True))
        print(f"wrote {literal(report['out'])}/report.json, report.html and report/*.png")
        return 0
    if args.command == "inspect":
        from eagle_data.tools.inspect_out import inspect

        print(inspect(args.out, args.sample_id, args.n))
        return 0
    if args.command == "export":
        from eagle_data.tools.export import run_cli

        return run_cli(args)
    from eagle_data.tools.vocab import run_cli  # vocab: argparse allows no other command

    return run_cli(args)


if __name__ == "__main__":
    exit_with(main())
