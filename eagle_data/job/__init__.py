"""The job: phases/ (orchestration), stages/ (the map_batches steps), and what they share:
fingerprints.py (what makes a phase's config), progress.py (the progress line) and
ray_internals.py (what works around Ray 2.60 itself; what works around vLLM is in
stages/engines/)."""
