"""The OUT folder: its contract (folders, schemas, ids, manifest), storage, shard publishing,
manifest and the per-sample status that resume reads. Imports nothing else of eagle_data
but config."""
