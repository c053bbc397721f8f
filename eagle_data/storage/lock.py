"""One run at a time per OUT: the lock file, and taking over one that a killed run left."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import uuid

import pyarrow.fs as pafs

from eagle_data.errors import OutputLocked
from eagle_data.storage import manifest as mf
from eagle_data.storage.contract import LOCK
from eagle_data.storage.folder import Output

log = logging.getLogger("eagle_data")


@contextlib.contextmanager
def lock(out: Output):
    """One run at a time per OUT. The lock file is created atomically (O_CREAT|O_EXCL on
    a local or network filesystem; an object store has no exclusive create, so there the
    check and the write are two steps). A lock left by a killed run (its process is gone)
    is taken over, with a message."""
    path = f"{out.root}/{LOCK}"
    out.fs.create_dir(out.root, recursive=True)
    mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": mf.now()}).encode()
    while not _create_exclusive(out.fs, path, mine):
        held = _read_lock(out.fs, path)
        if held is None:
            continue  # released between our two calls: try again
        if held.get("host") != socket.gethostname():
            raise OutputLocked(f"{out.root} is locked by a run on host {held.get('host')} "
                               f"(pid {held.get('pid')}); if that run is gone, delete {path}")
        if _alive(held.get("pid")):
            raise OutputLocked(f"{out.root} is being written by another run (pid {held['pid']}, "
                               f"started {held.get('started')}); wait for it or stop it first")
        _take_over(out, path, held)
    try:
        yield
    finally:
        out.fs.delete_file(path)


def _create_exclusive(fs, path: str, payload: bytes) -> bool:
    if isinstance(fs, pafs.LocalFileSystem):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        return True
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        return False
    with fs.open_output_stream(path) as f:
        f.write(payload)
    return True


def _take_over(out: Output, path: str, held: dict) -> None:
    """Remove a dead run's lock, unless another run replaced it meanwhile."""
    aside = f"{path}.{uuid.uuid4().hex}"
    try:
        out.fs.move(path, aside)
    except OSError:
        return  # another run moved it first: compete for the new one
    if _read_lock(out.fs, aside) != held:  # we moved a live run's fresh lock: give it back
        out.fs.move(aside, path)
        raise OutputLocked(f"{out.root} was just locked by another run; wait for it or stop it first")
    out.fs.delete_file(aside)
    log.warning("taking over the lock on %s left by pid %s (started %s), which is no longer running",
                out.root, held.get("pid"), held.get("started"))


def _read_lock(fs, path: str) -> dict | None:
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read() or b"{}")
    except (OSError, ValueError):  # none, or unreadable: nobody holds it
        return None


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True
