"""The job's phases, orchestration only: read, the stages in order, publish, record.
run.py checks the setup and runs them; prompts.py and generate.py are phases 1 and 2."""
