"""acceptance.path: the acceptance job's own folder, what it holds, and how it is written.

    report.json, per_prompt.jsonl, acceptance.png   the report, from every pass
    passes/<pass>.json                              each finished pass (passes.py)
    .<name>.tmp                                     a file being written (any of the above),
                                                    renamed into place once whole

Checked at start, before Ray or any engine (an hour of passes must not end on a folder that
cannot be written): a folder of other files is refused (never a file the job did not
write: it neither replaces nor deletes one), the folder is made and written to, and the
temporary files an earlier run left (a kill, a full disk) are the job's own and removed.
"""

from __future__ import annotations

import os
import re
from typing import Callable

from eagle_data.errors import ForeignFiles, NotWritable

REPORT_FILES = ("report.json", "per_prompt.jsonl", "acceptance.png")
PASSES = "passes"
PASS_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.json$")
PROBE = "write-check"  # written (as its temporary file) and removed at start


def temporary(path: str) -> str:
    """Where `path` is written before it is renamed into place: beside it, hidden."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.tmp")


def is_temporary(name: str, whole: Callable[[str], bool]) -> bool:
    return name.startswith(".") and name.endswith(".tmp") and whole(name[1:-4])


def ours_at_top(name: str) -> bool:
    whole = lambda n: n in REPORT_FILES or n == PROBE  # noqa: E731
    return whole(name) or name == PASSES or is_temporary(name, whole)


def ours_in_passes(name: str) -> bool:
    return bool(PASS_FILE.match(name)) or is_temporary(name, lambda n: bool(PASS_FILE.match(n)))


def prepare(folder: str) -> None:
    """The report folder, checked, made and written to (module docstring); a problem is one
    error naming acceptance.path (exit 2)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotWritable(f"acceptance.path {folder} is a file: give a folder")
    foreign = [name for name in listing(folder) if not ours_at_top(name)]
    passes = os.path.join(folder, PASSES)
    if os.path.isdir(passes):
        foreign += [f"{PASSES}/{name}" for name in listing(passes) if not ours_in_passes(name)]
    elif os.path.lexists(passes):
        foreign.append(PASSES)
    if foreign:
        raise ForeignFiles(f"acceptance.path {folder} holds files the acceptance job did not write "
                           f"({', '.join(sorted(foreign)[:5])}): choose an empty or new folder")
    try:
        os.makedirs(passes, exist_ok=True)
        write_atomically(os.path.join(folder, PROBE), b"")
        os.remove(os.path.join(folder, PROBE))
    except OSError as e:
        raise NotWritable(f"acceptance.path {folder} cannot be written ({e.strerror or e}): give a folder this job "
                          "can make and write to") from None
    for place, names in ((folder, listing(folder)), (passes, listing(passes))):
        for name in names:
            if name.startswith(".") and name.endswith(".tmp"):  # ours (checked above): an earlier run's, cut short
                os.remove(os.path.join(place, name))


def listing(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):  # made at start, or found unwritable then
        return []
    except OSError as e:
        raise NotWritable(f"acceptance.path {folder} cannot be read ({e.strerror or e})") from None


def write_atomically(path: str, content: bytes | str | Callable[[str], None]) -> None:
    """`path` written whole or not at all: into its temporary file, then renamed over it.
    `content` is the bytes or text, or a function that writes the file at the path it is given."""
    aside = temporary(path)
    if callable(content):
        content(aside)
    else:
        with open(aside, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
    os.replace(aside, path)
