"""OUT: its filesystem, manifest and folders, its writers, and the checks made before any
work starts (writable, nothing in it we did not write). The lock is in storage/lock.py,
damaged shards in storage/damage.py."""

from __future__ import annotations

import logging
import uuid

import pyarrow as pa
import pyarrow.fs as pafs

from eagle_data.storage import manifest as mf
from eagle_data.errors import EagleDataError, ForeignFiles, NotAnOut, NotWritable
from eagle_data.storage.contract import (FOLDERS, LOCK, MANIFEST, OWNED_FILES, OWNED_FOLDERS, PHASES, QUARANTINE,
                                         REPORT_FIGURES, REPORT_FILES, STAGING, VOCAB, is_ours)
from eagle_data.storage.files import filesystem, list_folder
from eagle_data.storage.shards import ShardWriter, shard_files

# How a lost or damaged manifest.json is recovered, keeping the data (docs/robustness.md).
REBUILD = ("rerun the job with the config that made this OUT: it rebuilds manifest.json from the "
           "shards' footers and keeps the data")

log = logging.getLogger("eagle_data")


class Output:
    def __init__(self, path: str, fs=None, fresh: bool = False):
        """`fresh`: opened to be wiped (--fresh), so an OUT of another manifest version is no error."""
        self.fs, self.root = filesystem(path, fs)
        self.manifest = mf.Manifest(self.fs, self.root, check_version=not fresh)

    @classmethod
    def existing(cls, path: str, fs=None) -> "Output":
        """An OUT a tool or the reader reads: refused unless a job made it (it has a manifest.json)."""
        out = cls(path, fs)
        if out.manifest.damaged:
            raise EagleDataError(f"{out.manifest.path} is damaged ({out.manifest.damaged}); {REBUILD} "
                                 "(the damaged file is moved to quarantine/)")
        if not out.manifest.exists:
            info = out.fs.get_file_info(out.root)
            if info.type == pafs.FileType.NotFound:
                raise NotAnOut(path, "no such folder")
            raise NotAnOut(path, f"no {MANIFEST}" + (f"; it holds eagle-data shards: {REBUILD}" if out.has_shards() else ""))
        return out

    def has_shards(self) -> bool:
        return any(shard_files(self.fs, self.folder(name)) for name in FOLDERS)

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
        return ShardWriter(self.fs, self.root, folder, schema, run_id, rows_per_shard, flush_seconds,
                           metadata=self.manifest.shard_metadata(folder, run_id))

    def wipe(self) -> None:
        """--fresh: delete everything earlier runs made (the report and vocab/ too: derived from
        the deleted rows), but not the lock this run holds. check_ours ran first: all of it is ours."""
        self.remove(*OWNED_FOLDERS)
        for name in OWNED_FILES:
            if name != LOCK and self.fs.get_file_info(self.folder(name)).is_file:
                self.fs.delete_file(self.folder(name))
        self.manifest = mf.Manifest(self.fs, self.root)  # a new OUT: a new out_id

    def reset(self, phase: str) -> None:
        """--fresh --phase X: delete X's rows and all made from them (the folders, quarantined
        shards and manifest records of X and the phases after it; the report; vocab/, made from
        data/, unless only the hidden-states phase is reset). The phases before X stay, with
        the OUT's out_id their shards carry."""
        names = [p.name for p in PHASES]
        later = PHASES[names.index(phase):]
        for record in later:
            self.remove(*record.folders, *(f"{QUARANTINE}/{f}" for f in record.folders))
            self.manifest.data["phases"].pop(record.name, None)
        self.remove(REPORT_FIGURES, *([VOCAB] if "generate" in (r.name for r in later) else []))
        for name in REPORT_FILES:
            if self.fs.get_file_info(self.folder(name)).is_file:
                self.fs.delete_file(self.folder(name))
        if self.manifest.exists:
            self.manifest.save()

    def holds_rows(self, phase: str) -> bool:
        """Whether any folder of `phase` holds a published shard (its rows, done or failed)."""
        record = next(p for p in PHASES if p.name == phase)
        return any(f.is_file for name in record.folders for f in list_folder(self.fs, self.folder(name)))

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
        found = list_folder(self.fs, self.root, recursive=True)  # a name not UTF-8: UndecodableName
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
