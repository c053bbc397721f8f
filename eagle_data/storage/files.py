"""OUT's storage: a pyarrow filesystem for a local path or URI, and small JSON files
(the manifest, the lock) written atomically."""

from __future__ import annotations

import json
import os
import uuid

import pyarrow.fs as pafs

from eagle_data.storage.contract import STAGING


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path within it) for a local path or a URI such as s3://bucket/out."""
    if "://" not in path:
        path = os.path.abspath(os.path.expanduser(path))
    return pafs.FileSystem.from_uri(path)


def write_json(fs: pafs.FileSystem, path: str, data: dict) -> None:
    """Atomically replace a small JSON file (the manifest)."""
    tmp = f"{path.rsplit('/', 1)[0]}/{STAGING}/{uuid.uuid4().hex}.json"
    fs.create_dir(tmp.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(tmp) as f:
        f.write(json.dumps(data, indent=2, sort_keys=True, default=str).encode())
    fs.move(tmp, path)


def read_json(fs: pafs.FileSystem, path: str) -> dict | None:
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as f:
        return json.loads(f.read())
