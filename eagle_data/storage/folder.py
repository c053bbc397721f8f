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

from eagle_data.storage import manifest as mf
from eagle_data.errors import ForeignFiles, NotAnOut, NotWritable, OutputLocked
from eagle_data.storage.contract import FOLDERS, LOCK, MANIFEST, QUARANTINE, STAGING, is_ours
from eagle_data.storage.files import filesystem
from eagle_data.storage.shards import ShardWriter, shard_files

log = logging.getLogger("eagle_data")


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

    def writer(self, folder: str, schema: pa.Schema, run_id: str, rows_per_shard: int,
               flush_seconds: float = float("inf")) -> ShardWriter:
        """Shards of `rows_per_shard` rows, or fewer once `flush_seconds` passed since the last."""
        return ShardWriter(self.fs, self.root, folder, schema, run_id, rows_per_shard, flush_seconds)

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

    def foreign_files(self) -> list[str]:
        """Files in OUT that the project did not write (paths relative to OUT)."""
        info = self.fs.get_file_info(self.root)
        if info.type == pafs.FileType.NotFound:
            return []
        if info.type != pafs.FileType.Directory:
            return ["."]  # output.path is a file
        found = self.fs.get_file_info(pafs.FileSelector(self.root, recursive=True))
        relative = (f.path[len(self.root) + 1:] for f in found if f.type == pafs.FileType.File)
        return sorted(r for r in relative if not is_ours(r) or (r == MANIFEST and self.manifest.foreign))

    def check_ours(self) -> None:
        """Refuse an output.path holding anything the project did not write: a run (and
        --fresh) deletes and moves files in OUT, and must never touch a user's."""
        foreign = self.foreign_files()
        if foreign == ["."]:
            raise NotWritable(f"output.path {self.root} is a file, not a folder; choose a folder")
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ForeignFiles(
                f"output.path {self.root} holds files eagle-data did not write ({shown}): it is not an "
                "eagle-data OUT, or someone put them there. Nothing was changed; move them out, or "
                "choose an empty or new folder for output.path")

    @contextlib.contextmanager
    def lock(self):
        """One run at a time per OUT. The lock file is created atomically (O_CREAT|O_EXCL on
        a local or network filesystem; an object store has no exclusive create, so there the
        check and the write are two steps). A lock left by a killed run (its process is gone)
        is taken over, with a message."""
        path = f"{self.root}/{LOCK}"
        self.fs.create_dir(self.root, recursive=True)
        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": mf.now()}).encode()
        while not self._create_exclusive(path, mine):
            held = self._read_lock(path)
            if held is None:
                continue  # released between our two calls: try again
            if held.get("host") != socket.gethostname():
                raise OutputLocked(f"{self.root} is locked by a run on host {held.get('host')} "
                                   f"(pid {held.get('pid')}); if that run is gone, delete {path}")
            if _alive(held.get("pid")):
                raise OutputLocked(f"{self.root} is being written by another run (pid {held['pid']}, "
                                   f"started {held.get('started')}); wait for it or stop it first")
            self._take_over(path, held)
        try:
            yield
        finally:
            self.fs.delete_file(path)

    def _create_exclusive(self, path: str, payload: bytes) -> bool:
        if isinstance(self.fs, pafs.LocalFileSystem):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            return True
        if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
            return False
        with self.fs.open_output_stream(path) as f:
            f.write(payload)
        return True

    def _take_over(self, path: str, held: dict) -> None:
        """Remove a dead run's lock, unless another run replaced it meanwhile."""
        aside = f"{path}.{uuid.uuid4().hex}"
        try:
            self.fs.move(path, aside)
        except OSError:
            return  # another run moved it first: compete for the new one
        if self._read_lock(aside) != held:  # we moved a live run's fresh lock: give it back
            self.fs.move(aside, path)
            raise OutputLocked(f"{self.root} was just locked by another run; wait for it or stop it first")
        self.fs.delete_file(aside)
        log.warning("taking over the lock on %s left by pid %s (started %s), which is no longer running",
                    self.root, held.get("pid"), held.get("started"))

    def _read_lock(self, path: str) -> dict | None:
        try:
            with self.fs.open_input_stream(path) as f:
                return json.loads(f.read() or b"{}")
        except (OSError, ValueError):  # none, or unreadable: nobody holds it
            return None

    def quarantine_corrupt(self) -> list[str]:
        """Move shards that do not read back whole (truncated, overwritten, a byte flipped in
        a page: every page is read and its checksum checked) out of the folders that are
        read, into OUT/quarantine/, so that resume and readers never take them as data. Their
        samples are then simply not done and get generated again; a damaged prompts/ or
        skipped/ shard makes the prompts phase run again. Cost: one read of OUT per run."""
        moved = []
        for folder in FOLDERS:
            for path in shard_files(self.fs, self.folder(folder)):
                problem = read_problem(self.fs, path)
                if problem:
                    dest = f"{self.folder(QUARANTINE)}/{folder}/{os.path.basename(path)}"
                    self.fs.create_dir(os.path.dirname(dest), recursive=True)
                    self.fs.move(path, dest)
                    log.warning("quarantined damaged shard %s -> %s (%s)", path, dest, problem)
                    moved.append(path)
                    if folder in ("prompts", "skipped"):
                        self.manifest.mark_prompts("damaged")
        if moved:
            self.manifest.save()
        return moved

    def check_prompts_record(self) -> None:
        """A finished prompts phase whose prompts/ or skipped/ no longer hold the rows it
        recorded (a shard deleted) is made again: prompts are deterministic, so the ids
        already in data/ stay valid."""
        if not self.manifest.prompts_complete():
            return
        counts = self.manifest.prompts_counts
        for folder in ("prompts", "skipped"):
            rows = sum(_rows(self.fs, f) for f in shard_files(self.fs, self.folder(folder)))
            if rows != counts.get(folder):
                log.warning("%s/ holds %d rows, the prompts phase recorded %s: making the prompts again",
                            folder, rows, counts.get(folder))
                self.manifest.mark_prompts("damaged")
                self.manifest.save()
                return


def read_problem(fs, path: str) -> str | None:
    """Why a shard does not read back whole, or None."""
    try:
        with fs.open_input_file(path) as f:
            pq.ParquetFile(f, page_checksum_verification=True).read()
    except (OSError, pa.ArrowException) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _rows(fs, path: str) -> int:
    with fs.open_input_file(path) as f:
        return pq.read_metadata(f).num_rows


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True
