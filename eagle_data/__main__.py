"""`python -m eagle_data COMMAND OUT ...`: tools that work on an OUT folder, one module each
in eagle_data/tools (its `add_cli` adds the command, its `run_cli` runs it). A user error
prints `error: ...` and exits with its code (eagle_data.errors); `verify` exits 1 when it
finds a problem, a result rather than an error."""

from __future__ import annotations

import argparse

from eagle_data.errors import cli, exit_with, stop_on_signals
from eagle_data.tools import export, inspect_out, report, verify, vocab

TOOLS = (verify, report, inspect_out, export, vocab)  # in the order `--help` lists them


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_data")
    commands = parser.add_subparsers(dest="command", required=True)
    for tool in TOOLS:
        tool.add_cli(commands)
    args = parser.parse_args(argv)
    stop_on_signals()  # SIGTERM unwinds like Ctrl-C: a file half written aside is removed
    # What a command writes: export's and vocab's destination, else OUT (report, vocab).
    return cli(lambda: args.run(args), writing=lambda: getattr(args, "dest", None) or args.out)


if __name__ == "__main__":
    exit_with(main())
