"""Bytes written to and read from the files under a folder while something runs, as the
kernel reports each file's opens and closes (inotify, no privileges needed): a file closed
after writing counts its size at that moment; a file opened read-only counts its size once,
however often it is opened (safetensors opens a file twice to load it; what a reader that
maps or reads it whole takes, an upper bound for a partial read). Moves and removals move
no bytes: a file is known by its inode, so a file moved into a folder made while watching
is not taken for a new one.

A file removed before its size could be taken counts the size `fallback(path)` gives (the
caller knows what it held) and is reported in `estimated`. Folders made while watching are
watched from the moment they are seen, and the files they already hold that were not seen
before are taken as written then; a file read in such a folder before it is seen is missed,
so a caller that counts reads makes the folders they happen in before watching.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from collections import Counter

IN_CLOSE_WRITE, IN_CLOSE_NOWRITE, IN_CREATE, IN_ISDIR = 0x8, 0x10, 0x100, 0x40000000
IN_NONBLOCK = 0o4000
EVENT = struct.Struct("iIII")


class FileTraffic:
    def __init__(self, root: str, fallback=lambda path: 0, name_filter=lambda name: True):
        self.root, self.fallback, self.name_filter = root, fallback, name_filter
        self.written: dict[str, int] = {}  # path -> bytes written (its size at the last close after writing)
        self.read: dict[str, int] = {}  # path -> its size, for each file opened read-only
        self.opens = Counter()  # path -> read-only opens
        self.estimated: set[str] = set()
        self._inodes: dict[tuple[int, int], str] = {}  # the files written, by inode
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(IN_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._dirs: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "FileTraffic":
        for folder, _, _ in os.walk(self.root):
            self._watch(folder, take_existing=False)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        os.close(self._fd)

    def _watch(self, folder: str, take_existing: bool) -> None:
        wd = self._libc.inotify_add_watch(self._fd, folder.encode(), IN_CLOSE_WRITE | IN_CLOSE_NOWRITE | IN_CREATE)
        if wd < 0:
            return  # gone already
        self._dirs[wd] = folder
        if take_existing:
            for name in os.listdir(folder) if os.path.isdir(folder) else ():
                path = os.path.join(folder, name)
                if os.path.isdir(path):
                    self._watch(path, take_existing=True)
                elif self.name_filter(name):
                    self._wrote(path, moved_in_maybe=True)

    def _wrote(self, path: str, moved_in_maybe: bool = False) -> None:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            self.written[path] = self.fallback(path)
            self.estimated.add(path)
            return
        inode = (info.st_dev, info.st_ino)
        if moved_in_maybe and inode in self._inodes:
            return  # written under another name already, then moved here
        self._inodes[inode] = path
        self.written[path] = info.st_size

    def _loop(self) -> None:
        while True:
            ready, _, _ = select.select([self._fd], [], [], 0.05)
            if not ready:
                if self._stop.is_set():
                    return
                continue
            try:
                data = os.read(self._fd, 1 << 20)
            except BlockingIOError:
                continue
            offset = 0
            while offset < len(data):
                wd, mask, _, size = EVENT.unpack_from(data, offset)
                name = data[offset + EVENT.size:offset + EVENT.size + size].rstrip(b"\0").decode()
                offset += EVENT.size + size
                folder = self._dirs.get(wd)
                if folder is None or not name:
                    continue
                path = os.path.join(folder, name)
                if mask & IN_ISDIR:
                    if mask & IN_CREATE:
                        self._watch(path, take_existing=True)
                elif not self.name_filter(name):
                    continue
                elif mask & IN_CLOSE_WRITE:
                    self._wrote(path)
                elif mask & IN_CLOSE_NOWRITE:
                    self.opens[path] += 1
                    self.read.setdefault(path, self.written.get(path) or _size(path))

    @property
    def written_bytes(self) -> int:
        return sum(self.written.values())

    def read_bytes(self, where=lambda path: True) -> int:
        return sum(size for path, size in self.read.items() if where(path))


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0
