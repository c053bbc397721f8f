"""Tools that work on an OUT folder (`python -m eagle_data ...`): verify, report, inspect,
export, vocab, a module each whose `add_cli(subparsers)` adds its command and `run_cli(args)`
runs it (token_counts counts for vocab; terminal prints data text literally)."""
