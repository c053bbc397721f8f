"""Storage for OUT and the tools' outputs: one filesystem resolver for every path or URI
the project takes, and one way to write a file whole or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import stat
import uuid
from typing import Callable

import pyarrow as pa
import pyarrow.fs as pafs

from eagle_data.errors import NotWritable, UndecodableName
from eagle_data.storage.contract import STAGING


def filesystem(path: str, fs=None) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path within it) for a local path, a URI pyarrow knows (s3://,
    gs://, hdfs://, file://) or any other fsspec URI (memory://, az://, ...). `fs` may be
    given as a pyarrow or fsspec filesystem, then `path` is a path within it. The job, the
    tools and the reader all resolve here, so the job writes to every URI the reader reads."""
    if fs is None:
        if "://" not in path:
            return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
        try:
            return pafs.FileSystem.from_uri(path)
        except (ValueError, pa.ArrowNotImplementedError):  # a protocol pyarrow lacks
            import fsspec  # only then: a local or s3:// OUT needs no fsspec

            fs, path = fsspec.core.url_to_fs(path)
    if not isinstance(fs, pafs.FileSystem):  # an fsspec filesystem
        fs = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    return fs, path.rstrip("/") or "/"


def refuse_inside_out(out: str, dest: str, what: str, allowed: str | None = None) -> None:
    """A tool's DEST inside the OUT it reads (by real path, through symlinks; OUT itself too),
    save `allowed` (the tool's own place there, e.g. OUT/vocab): an error. OUT holds only
    the files the job writes, and a job run refuses an OUT holding any other."""
    out_fs, out_root = filesystem(out)
    dest_fs, dest_path = filesystem(dest)
    if isinstance(out_fs, pafs.LocalFileSystem) and isinstance(dest_fs, pafs.LocalFileSystem):
        real = os.path.realpath
    elif out_fs.type_name == dest_fs.type_name:
        real = posixpath.normpath
    else:
        return
    root, target = real(out_root), real(dest_path)
    if allowed is not None and target == real(filesystem(allowed)[1]):
        return
    if target == root or target.startswith(root.rstrip("/") + "/"):
        raise NotWritable(f"{what} {dest} is inside the OUT it reads ({out}): OUT holds only the files the job "
                          "writes, and the next job run would refuse it; give a destination outside it")


KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def list_folder(fs: pafs.FileSystem, folder: str, recursive: bool = False) -> list[pafs.FileInfo]:
    """What `fs.get_file_info(FileSelector(folder))` lists (nothing for a missing folder),
    or UndecodableName naming a file whose name is not UTF-8 (pyarrow raised a
    UnicodeDecodeError naming none, at the first read of its path). Every listing of OUT goes through here."""
    try:
        found = fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True, recursive=recursive))
        for info in found:
            info.path  # decoded here: pyarrow decodes a FileInfo's path when it is read
    except UnicodeDecodeError:
        raise UndecodableName(_undecodable(folder, recursive)) from None
    return found


def _undecodable(folder: str, recursive: bool) -> str:
    """The first path under a local folder whose name is not UTF-8, shown with \\x escapes."""
    for root, dirs, names in os.walk(os.fsencode(folder)):
        for name in sorted(dirs + names):
            try:
                name.decode()
            except UnicodeDecodeError:
                return os.path.join(root, name).decode(errors="backslashreplace")
        if not recursive:
            break
    return f"a name in {folder}"


def kind_of(mode: int) -> str:
    """What a non-regular st_mode is, with its article ("a FIFO (named pipe)", ...)."""
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def not_a_regular_file(fs: pafs.FileSystem, path: str) -> str | None:
    """What is at `path` when it is something other than a regular file ("a FIFO (named
    pipe)", "a symlink to ...", ...), None for a regular file or nothing. A local path is
    looked at with lstat, which does not follow a symlink: replacing a symlink, even one to
    a regular file, destroys the user's link; replacing a device node (as root: /dev/null)
    breaks it for the whole machine. An object store holds only objects and folder-like
    prefixes."""
    if isinstance(fs, pafs.LocalFileSystem):
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):  # nothing there (or a parent is a file)
            return None
        if stat.S_ISREG(mode):
            return None
        return f"a symlink to {os.readlink(path)}" if stat.S_ISLNK(mode) else kind_of(mode)
    kind = fs.get_file_info(path).type
    if kind in (pafs.FileType.File, pafs.FileType.NotFound):
        return None
    return "a folder" if kind == pafs.FileType.Directory else "not a regular file"


def check_replaceable(fs: pafs.FileSystem, path: str) -> None:
    """Refuse (NotWritable, naming it) to write `path` when anything but a regular file is there."""
    kind = not_a_regular_file(fs, path)
    if kind is not None:
        raise NotWritable(f"{path} is {kind}, not a regular file: refusing to replace it (this project "
                          "writes only regular files); give another name, or remove it yourself")


def write_atomically(fs: pafs.FileSystem, path: str, write: Callable[[str], None],
                     staging: str | None = None) -> str:
    """Make `path` appear whole or not at all: `write(tmp)` writes a temporary file, which
    is then moved over `path` (replacing it). The only place the project moves a freshly
    written file into place.

    The temporary file is `staging/<id><ext>` when `staging` is given (OUT/.staging/, which
    nothing reads and each run clears), else a hidden `.<name>.<id>.tmp` beside `path`
    (for DESTs outside OUT). A failed write deletes it; a killed one leaves only it, which
    no reader or resume takes as data. On a local or network filesystem the move is a
    rename (atomic); on an object store it is a finished upload or copy (atomic too).

    Only a regular file (or nothing) at `path` is replaced: anything else is refused, before
    the write and again just before the move (check_replaceable)."""
    check_replaceable(fs, path)
    parent, name = posixpath.split(path)
    parent = parent or "."
    if staging is not None:
        tmp = f"{staging}/{uuid.uuid4().hex}{posixpath.splitext(name)[1]}"
    else:
        tmp = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp"
    for folder in {posixpath.dirname(tmp), parent}:
        fs.create_dir(folder, recursive=True)
    try:
        write(tmp)
        check_replaceable(fs, path)  # what may have appeared there while `write` ran
        fs.move(tmp, path)
    except BaseException:
        # Cleaning up must not hide why the write failed (the storage may be what failed).
        with contextlib.suppress(OSError):
            if fs.get_file_info(tmp).is_file:
                fs.delete_file(tmp)
        raise
    return path


def write_bytes(fs: pafs.FileSystem, path: str, data: bytes, staging: str | None = None) -> str:
    """`data` as the whole of `path`; see write_atomically."""
    def write(tmp: str) -> None:
        with fs.open_output_stream(tmp) as f:
            f.write(data)
    return write_atomically(fs, path, write, staging)


def write_json(fs: pafs.FileSystem, path: str, data: dict) -> None:
    """Atomically replace a small JSON file at OUT's top level (manifest, report), staged in
    OUT/.staging/."""
    payload = json.dumps(data, indent=2, sort_keys=True, default=str).encode()
    write_bytes(fs, path, payload, staging=f"{posixpath.dirname(path)}/{STAGING}")


def read_json(fs: pafs.FileSystem, path: str) -> dict | None:
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as f:
        return json.loads(f.read())
