"""The job: its two phases (prompts, generate) and their stages, in pipeline order:
source -> prompts -> [turns] -> engines -> postprocess, run by run.py."""
