"""The OUT folder: its contract (folders, schemas, ids, manifest), atomic files, shard
publishing, the manifest, the per-sample status that resume reads, and the report. Takes
plain values: imports nothing of eagle_data but errors (tests/test_layout.py)."""
