"""The job's stages, each one `map_batches` step with its columns declared (columns.py), in
pipeline order: source -> sample -> prompts -> [turns] -> requests -> engines -> postprocess."""
