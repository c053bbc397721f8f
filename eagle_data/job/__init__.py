"""The job: phases/ (orchestration), stages/ (the map_batches steps), and what they share:
fingerprints.py (what makes a phase's config), progress.py (the progress line) and
ray_internals.py (everything that depends on Ray 2.60's internals and its pinned vLLM)."""
