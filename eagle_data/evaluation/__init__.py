"""Measuring what the data is for: drafts the target accepts.

    acceptance.py          the acceptance job (ray_jobs/acceptance.py): the target with each
                           draft under vLLM's EAGLE-3 speculative decoding, greedy, over an
                           OUT's prompts, and the target alone; per prompt, what was accepted
    acceptance_report.py   the figures from those counts: mean acceptance length, acceptance
                           by position, per source with bootstrap intervals, lossless check,
                           tokens/s; report.json, per_prompt.jsonl, acceptance.png, the table
"""
