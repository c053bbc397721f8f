"""`python -m eagle_data COMMAND OUT`: tools that work on an OUT folder."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_data")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("verify", help="check the exactly-once and accounting invariants of OUT")
    check.add_argument("out")
    args = parser.parse_args(argv)

    if args.command == "verify":
        from eagle_data.verify import verify

        problems, counts = verify(args.out)
        print(json.dumps(counts, sort_keys=True))
        for p in problems:
            print(f"FAIL: {p}", file=sys.stderr)
        if not problems:
            print(f"OK: {args.out} holds every invariant")
        return 1 if problems else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
