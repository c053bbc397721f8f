"""Tools that work on an OUT folder (`python -m eagle_data ...`): verify, report, inspect,
export, vocab (token_counts counts for vocab)."""
