"""OUT: its filesystem, manifest and folders; the checks made before any work starts."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from eagle_data.out import manifest as mf
from eagle_data.config import Config
from eagle_data.errors import EagleDataError, NotAnOut, NotWritable
from eagle_data.out.contract import FOLDERS, MANIFEST
from eagle_data.out.files import STAGING, filesystem
from eagle_data.out.shards import ShardWriter, shard_files

log = logging.getLogger("eagle_data")

QUARANTINE = "quarantine"


class OutputLocked(EagleDataError):
    """Another run is writing this OUT: two writers would break exactly-once."""


class Output:
    def __init__(self, path: str):
        self.fs, self.root = filesystem(path)
        self.manifest = mf.Manifest(self.fs, self.root)

    @classmethod
    def existing(cls, path: str) -> "Output":
        """An OUT a tool reads: refused unless a job made it (it has a manifest.json)."""
        out = cls(path)
        if not out.manifest.exists:
            info = out.fs.get_file_info(out.root)
            raise NotAnOut(path, "no such folder" if info.type == pafs.FileType.NotFound else f"no {MANIFEST}")
        return out

    def folder(self, name: str) -> str:
        return f"{self.root}/{name}"

    def remove(self, *folders: str) -> None:
        for name in folders:
            self.fs.delete_dir_contents(self.folder(name), missing_dir_ok=True)

    def clear_staging(self) -> None:
        """Files a killed run left half-written; nothing reads them."""
        self.remove(STAGING)

    def writer(self, folder: str, schema: pa.Schema, run_id: str, cfg: Config, flush: bool) -> ShardWriter:
        return ShardWriter(self.fs, self.root, folder, schema, run_id, cfg.output.rows_per_shard,
                           cfg.output.flush_seconds if flush else float("inf"))

    def wipe(self) -> None:
        """--fresh: delete what earlier runs made (not the lock this run holds)."""
        self.remove(*FOLDERS, QUARANTINE, STAGING)
        if self.fs.get_file_info(self.manifest.path).is_file:
            self.fs.delete_file(self.manifest.path)
        self.manifest = mf.Manifest(self.fs, self.root)

    def check_writable(self) -> None:
        probe = f"{self.folder(STAGING)}/probe-{uuid.uuid4().hex}"
        try:
            self.fs.create_dir(self.folder(STAGING), recursive=True)
            with self.fs.open_output_stream(probe) as f:
                f.write(b"ok")
            self.fs.delete_file(probe)
        except OSError as e:
            raise NotWritable(
                f"output.path {self.root} is not writable ({e}); choose another output.path "
                "(with more than one node: storage every node sees, an NFS/EFS mount or s3://...)"
            ) from None

    @contextlib.contextmanager
    def lock(self):
        """One run at a time per OUT. A lock left by a killed run (its process is gone) is taken over."""
        path = f"{self.root}/.lock"
        held = self._read_lock(path)
        if held and held.get("host") == socket.gethostname() and _alive(held.get("pid")):
            raise OutputLocked(f"{self.root} is being written by another run (pid {held['pid']}, "
                               f"started {held.get('started')}); wait for it or stop it first")
        if held and held.get("host") != socket.gethostname():
            raise OutputLocked(f"{self.root} is locked by a run on host {held.get('host')} "
                               f"(pid {held.get('pid')}); if that run is gone, delete {path}")
        if held:  # same host, its process is gone: a killed or stopped run
            log.warning("taking over the lock on %s left by pid %s (started %s), which is no "
                        "longer running", self.root, held.get("pid"), held.get("started"))
        with self.fs.open_output_stream(path) as f:
            f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                "started": mf.now()}).encode())
        try:
            yield
        finally:
            self.fs.delete_file(path)

    def _read_lock(self, path: str) -> dict | None:
        try:
            with self.fs.open_input_stream(path) as f:
                return json.loads(f.read() or b"{}")
        except (OSError, ValueError):  # none, or unreadable: nobody holds it
            return None

    def quarantine_corrupt(self) -> list[str]:
        """Move shards whose Parquet footer cannot be read (truncated, overwritten) out of
        the folders that are read, into OUT/quarantine/, so that resume and readers never take
        them as data. Their samples are then simply not done and get generated again; a
        damaged prompts/ or skipped/ shard makes the prompts phase run again."""
        moved = []
        for folder in FOLDERS:
            for path in shard_files(self.fs, self.folder(folder)):
                try:
                    with self.fs.open_input_file(path) as f:
                        pq.read_metadata(f)
                except (OSError, pa.ArrowException) as e:
                    dest = f"{self.folder(QUARANTINE)}/{folder}/{os.path.basename(path)}"
                    self.fs.create_dir(os.path.dirname(dest), recursive=True)
                    self.fs.move(path, dest)
                    log.warning("quarantined unreadable shard %s -> %s (%s)", path, dest, e)
                    moved.append(path)
                    if folder in ("prompts", "skipped"):
                        self.manifest.mark_prompts("damaged")
        if moved:
            self.manifest.save()
        return moved


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True
