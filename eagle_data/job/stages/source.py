"""Reading the chat dataset (the sample is picked in job/stages/sample.py).

Every row becomes `row_id` (hash of its content), `source`, `raw` (the row as JSON text),
`origin` ("FILE:LINE" for jsonl and JSON array files, "" otherwise) and `read_error`
("" or `REASON: why`: `bad_encoding`, a line that is not valid UTF-8, or `bad_file`, the
part of a damaged file from where it cannot be read on). Keeping the row as text until the
prompts stage parses it means a malformed row (wrong types, missing keys, a line that is
not JSON or not UTF-8) cannot break Arrow's schema inference or crash a reader: it reaches
the prompts stage and is skipped there with a reason that names its file and line. Each
file is read on its own (no schema shared between files).

Supported layouts (`locate` checks them before Ray starts and refuses anything else):
jsonl (plain or .gz), parquet, a `.json` file holding one JSON array of records, a
`datasets.save_to_disk` folder, a folder or glob of such files, and a hub dataset id.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import hashlib
import json
import logging
import os
import stat
import zlib
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from eagle_data.config import SourceConfig
from eagle_data.model_files import is_hub_id
from eagle_data.errors import ConfigError, EagleDataError, MissingInput, UnsupportedDataset
from eagle_data.job.stages.columns import Stage, columns
from eagle_data.storage.files import kind_of

log = logging.getLogger("eagle_data")

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = ("jsonl (or .jsonl.gz), parquet, a .json array of records, a datasets.save_to_disk "
             "folder, or a hub dataset id")
RAW_SCHEMA = pa.schema([("row_id", pa.string()), ("source", pa.string()), ("raw", pa.string()),
                        ("origin", pa.string()), ("read_error", pa.string())])


@dataclass(frozen=True)
class Layout:
    """Where the rows are: `hub` (paths empty), `files` (jsonl/json/parquet files) or
    `saved` (one datasets.save_to_disk folder, its split or None for a plain Dataset)."""

    kind: str
    paths: tuple[str, ...] = ()
    split: str | None = None


# Suffixes that make a missing source.dataset a local path, not a hub id (hub ids such as
# `teknium/OpenHermes-2.5` may hold a dot, so not any suffix counts).
LOCAL_SUFFIXES = JSON_SUFFIXES + PARQUET_SUFFIXES + (
    ".gz", ".arrow", ".csv", ".tsv", ".txt", ".zip", ".bz2", ".xz", ".zst", ".tar", ".pq")


def locate(cfg: SourceConfig, out: str | None = None) -> Layout:
    """The dataset's layout, checked: a local path exists and holds only supported regular
    files (hidden files and *.md docs in a folder are ignored), each once, else an error
    naming the file. `out`: OUT's local path; a dataset and OUT may not contain each other."""
    dataset = cfg.dataset
    path = os.path.expanduser(dataset)
    folders: list[str] = []  # the folders read whole: OUT may not be inside one
    if os.path.lexists(path):  # an existing path is that path, even with glob characters in it
        if os.path.isdir(path):
            saved = _saved_layout(path, cfg.split)
            if saved is not None:
                _check_apart(dataset, (), saved.paths, out)
                return saved
            files = _folder_files(dataset, path, folders)
        else:
            files = [path]
    elif glob.has_magic(dataset):
        matched = _glob(path)
        if not matched:
            raise MissingInput(f"source.dataset {dataset!r} matches no files")
        files = []
        for match in matched:
            files += _folder_files(dataset, match, folders) if os.path.isdir(match) else (
                [] if _ignored(match) else [match])
    elif is_hub_id(dataset) and not dataset.lower().endswith(LOCAL_SUFFIXES):
        return Layout("hub")
    else:  # ./x, /x, ~/x, a/b/c, x.jsonl, or under a local folder
        raise MissingInput(f"source.dataset {dataset!r} does not exist (no such file or folder)")
    files = _unique(files)
    _check_apart(dataset, files, folders, out)
    if not files:
        raise MissingInput(f"source.dataset {dataset!r} holds no data files ({SUPPORTED})")
    for file in files:
        _check_file(dataset, file)
    return Layout("files", tuple(files))


def _ignored(path: str) -> bool:
    """Files a dataset folder may hold beside its data: hidden files and docs."""
    name = os.path.basename(path)
    return name.startswith(".") or name.lower().endswith(".md")


def _walk(folder: str):
    """os.walk following symlinked folders, each real folder once (a link back up the tree
    is not a loop), hidden folders (.git, .cache, ...) left out, in sorted order."""
    seen = set()
    for root, dirs, names in os.walk(folder, followlinks=True, onerror=_unlisted):
        st = os.stat(root)
        if (st.st_dev, st.st_ino) in seen:  # reached again through a symlink
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        yield root, dirs, sorted(names)


def _unlisted(error: OSError) -> None:
    """os.walk would skip a folder it cannot list, and its files would silently go unread."""
    raise MissingInput(f"source.dataset: the folder {error.filename} cannot be listed ({error.strerror})")


def _folder_files(dataset: str, folder: str, folders: list[str]) -> list[str]:
    """The files under `folder`; every folder walked is added to `folders`."""
    files = []
    for root, _, names in _walk(folder):
        folders.append(root)
        if _is_saved(root):  # (a dataset folder that is one itself never gets here)
            raise UnsupportedDataset(
                f"source.dataset {dataset!r}: {root} is a datasets.save_to_disk folder; "
                "set source.dataset to that folder itself")
        files += [os.path.join(root, n) for n in names if not _ignored(n)]
    return files


def _glob(pattern: str) -> list[str]:
    """The paths a glob matches. Python's `**` follows symlinked folders without
    end (a link back up the tree: 40 levels deep, then ELOOP), so a pattern with `**` is
    matched on _walk's tree instead; a matched folder is read whole, below it nothing
    more is matched."""
    parts = pattern.rstrip(os.sep).split(os.sep)  # (`DIR/**/` matches the folders: read whole)
    if "**" not in parts:
        return sorted(glob.glob(pattern))
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    top = os.sep.join(parts[:fixed]) or (os.sep if pattern.startswith(os.sep) else ".")
    rest = [part for part in parts[fixed:] if part not in ("", ".")]  # a//b, a/./b
    matched = []
    if not os.path.isdir(top):
        return matched
    for root, dirs, names in _walk(top):
        rel = [] if root == top else os.path.relpath(root, top).split(os.sep)
        if _matches(rel, rest):
            matched.append(root)
            dirs[:] = []
            continue
        matched += [os.path.join(root, n) for n in names if _matches(rel + [n], rest)]
    return matched


def _matches(names: list[str], pattern: list[str]) -> bool:
    """Glob's rules per path component: `**` is any number of them; a wildcard does not
    match a hidden name."""
    if not pattern:
        return not names
    if pattern[0] == "**":
        return any(_matches(names[i:], pattern[1:]) for i in range(len(names) + 1))
    if not names or (names[0].startswith(".") and not pattern[0].startswith(".")):
        return False
    return fnmatch.fnmatchcase(names[0], pattern[0]) and _matches(names[1:], pattern[1:])


def _unique(files: list[str]) -> list[str]:
    """Each file once, however many spellings (a glob's `**` and the folder it expands, a
    symlink) reach it: the first path found for each real file, absolute. A dangling link
    is kept (by its own path) for _check_file to name."""
    unique, seen = [], set()
    for file in files:
        try:
            st = os.stat(file)
            key = (st.st_dev, st.st_ino)
        except OSError:
            key = os.path.abspath(file)
        if key not in seen:
            seen.add(key)
            unique.append(os.path.abspath(file))
    return unique


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _check_apart(dataset: str, files, folders, out: str | None) -> None:
    """A dataset inside OUT would be deleted by --fresh or read back as output; an OUT
    inside a dataset folder would be read as dataset files on the next run. Real paths:
    a symlink does not hide either."""
    if out is None:
        return
    out = os.path.realpath(out)
    for folder in dict.fromkeys(os.path.realpath(f) for f in folders):
        if _inside(out, folder):
            raise EagleDataError(f"output.path {out} is inside the dataset folder {folder} "
                                 f"(source.dataset {dataset!r}): keep OUT outside the dataset")
    for path in [*files, *folders]:
        if _inside(os.path.realpath(path), out):
            raise EagleDataError(f"source.dataset {path} is inside output.path {out}: "
                                 "keep the dataset outside OUT")


def _check_file(dataset: str, path: str) -> None:
    """A regular, readable file of a supported type (a FIFO would block the read, a
    dangling link fail it after Ray starts); a parquet file's footer is read here."""
    named = "" if os.path.abspath(path) == os.path.abspath(os.path.expanduser(dataset)) else f"{dataset!r}: "
    where = f"source.dataset {named}{path}"
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if os.path.islink(path):
            raise MissingInput(f"{where} is a dangling symlink (to {os.readlink(path)!r})") from None
        raise MissingInput(f"{where} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise UnsupportedDataset(f"{where} is {kind_of(mode)}, not a regular file")
    lower = path.lower()
    if not lower.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES):
        if lower.endswith(".arrow"):
            hint = "read a datasets.save_to_disk folder by naming the folder itself"
        else:
            hint = f"supported: {SUPPORTED}"
        raise UnsupportedDataset(f"{where}: unsupported file type "
                                 f"{os.path.splitext(path)[1] or '(no suffix)'!r}; {hint}")
    try:
        if lower.endswith(PARQUET_SUFFIXES):
            pq.read_metadata(path)
        else:
            open(path, "rb").close()
    except (OSError, pa.ArrowException) as e:
        raise UnsupportedDataset(f"{where} cannot be read: {e}") from None


def _is_saved(folder: str) -> bool:
    has = lambda name: os.path.isfile(os.path.join(folder, name))  # noqa: E731
    return has("dataset_dict.json") or (has("state.json") and has("dataset_info.json"))


def _saved_layout(folder: str, split: str) -> Layout | None:
    """A datasets.save_to_disk folder: a DatasetDict (dataset_dict.json lists its splits,
    source.split picks one) or a single Dataset (state.json + dataset_info.json)."""
    if not _is_saved(folder):
        return None
    index = os.path.join(folder, "dataset_dict.json")
    if not os.path.isfile(index):
        return Layout("saved", (os.path.abspath(folder),))
    try:
        with open(index) as f:
            splits = json.load(f)["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MissingInput(f"source.dataset {folder!r}: unreadable {index} ({e})") from None
    if split not in splits:
        raise MissingInput(f"source.dataset {folder!r} has no split {split!r} (source.split); "
                           f"it has {splits}")
    return Layout("saved", (os.path.abspath(folder),), split)


def read_source(cfg: SourceConfig) -> ray.data.Dataset:
    """The dataset's raw rows (RAW), once source.fields is checked against the first rows."""
    layout = locate(cfg)
    field = source_field(cfg)
    if layout.kind == "hub":
        import datasets  # hub id: datasets downloads (or reuses its cache), Ray reads it

        try:
            hf = datasets.load_dataset(cfg.dataset, split=cfg.split)
        except Exception as e:  # network, cache miss, unknown id or split: all the user's to fix
            raise MissingInput(f"source.dataset {cfg.dataset!r} (split {cfg.split!r}) cannot be loaded "
                               f"from the hub or its local cache: {type(e).__name__}: {e}") from None
        check_fields(cfg, min(hf.num_rows, PEEK_ROWS), set(hf.column_names))
        return ray.data.from_huggingface(hf).map_batches(TableToRaw(field), batch_format="pyarrow")
    if layout.kind == "saved":
        import datasets

        try:
            hf = datasets.load_from_disk(layout.paths[0])
            if layout.split is not None:
                hf = hf[layout.split]
            table = hf.with_format("arrow")[:]
        except (OSError, ValueError, pa.ArrowException) as e:  # a damaged or cut .arrow file
            raise UnsupportedDataset(f"source.dataset {cfg.dataset!r}: the datasets.save_to_disk folder "
                                     f"{layout.paths[0]} cannot be read ({type(e).__name__}: {e})") from None
        check_fields(cfg, min(table.num_rows, PEEK_ROWS), set(table.column_names))
        # What ray.data.from_huggingface does for a local Dataset, without its first step:
        # asking the hub whether the dataset's name is a public dataset (a network round
        # trip, or retries when there is no network, for a folder on disk).
        return ray.data.from_arrow(table).map_batches(TableToRaw(field), batch_format="pyarrow")
    # One read task per file (per row group of a parquet file: a task's memory stays one
    # row group's), each read on its own: no schema is unified across files (a `source`
    # column that is string in one parquet file and dictionary in another is fine: every
    # row becomes JSON text), and a file damaged part way through keeps the rows before the
    # damage and gives one bad_file row naming it, instead of a failed Ray task.
    check_source_fields(cfg, layout)
    parts = [{"path": path, "row_group": group} for path in layout.paths for group in _row_groups(path)]
    return (ray.data.from_items(parts, override_num_blocks=max(1, len(parts)))
            .map_batches(FilesToRaw(field), batch_format="pyarrow", batch_size=1))


# How much of a dataset's start source.fields is checked against: its first rows, and at
# most this much of their files' text (a row may be large).
PEEK_ROWS = 1000
PEEK_BYTES = 16 << 20


def check_fields(cfg: SourceConfig, rows: int, fields: set[str]) -> None:
    """Refuse (ConfigError) a field source.fields names that none of the dataset's first
    `rows` rows has (`fields`: the fields they have): a misspelling, which would otherwise
    skip every row (user, assistant) or silently give none (system, source). A field some
    rows have is no misspelling: the rows without it are skipped one by one."""
    named = cfg.fields
    if named is None or rows == 0:
        return
    given = {"user": named.user, "assistant": named.assistant, "system": named.system,
             "source": named.source if "source" in named.model_fields_set else None}  # (default: `source`, if any)
    missing = [f"source.fields.{key} {name!r}" for key, name in given.items() if name is not None and name not in fields]
    if not missing:
        return
    have = sorted(fields)
    listed = ", ".join(have[:20]) + (f", ... ({len(have)} in all)" if len(have) > 20 else "")
    raise ConfigError(f"{' and '.join(missing)}: none of the first {rows} rows of source.dataset {cfg.dataset!r} "
                      f"has {'those fields' if len(missing) > 1 else 'that field'} (the rows' fields: "
                      f"{listed or 'none'}); set source.fields to the fields that hold the turns")


def check_source_fields(cfg: SourceConfig, layout: Layout) -> None:
    """check_fields on a files layout's first rows: cheap (a few MiB read at most), so run at
    start, before Ray; a saved or hub dataset's columns are checked once it is loaded."""
    if layout.kind == "files":
        check_fields(cfg, *first_rows_fields(layout.paths))


def first_rows_fields(paths: tuple[str, ...]) -> tuple[int, set[str]]:
    """(how many rows, their fields) of the files' first rows (up to PEEK_ROWS, PEEK_BYTES of
    text): a parquet file's columns are every row's; a jsonl or JSON array file's rows are
    read from its start. What cannot be read is left to the read, which names it."""
    rows, fields = 0, set()
    for path in paths:
        if rows >= PEEK_ROWS:
            break
        if path.lower().endswith(PARQUET_SUFFIXES):
            try:
                parquet = pq.ParquetFile(path)
            except (OSError, pa.ArrowException):
                continue
            if parquet.metadata.num_rows:
                rows += min(parquet.metadata.num_rows, PEEK_ROWS - rows)
                fields.update(parquet.schema_arrow.names)
            continue
        for record in first_records(path, PEEK_ROWS - rows):
            rows += 1
            fields.update(record)
    return rows, fields


def first_records(path: str, most: int) -> list[dict]:
    """The first (up to `most`) records of a jsonl or JSON array file (plain or gzip), read
    from up to PEEK_BYTES of its text; lines or records that are not JSON objects are left out."""
    data = b""
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        with (gzip.open if gzipped else open)(path, "rb") as f:
            while len(data) < PEEK_BYTES:
                chunk = f.read(min(1 << 20, PEEK_BYTES - len(data)))
                if not chunk:
                    break
                data += chunk
    except (OSError, EOFError, zlib.error):
        pass  # a cut or corrupt file: its start is checked, the read names the damage
    text = data.removeprefix(b"\xef\xbb\xbf").decode("utf-8", errors="replace")
    records = []
    if path.lower().endswith((".json", ".json.gz")) and text.lstrip()[:1] == "[":
        decoder, pos = json.JSONDecoder(), text.index("[") + 1
        while len(records) < most:
            try:
                record, end = decoder.raw_decode(text, _skip_space(text, pos))
            except (ValueError, RecursionError):
                break  # the array's end, or the end of the text read
            records += [record] if isinstance(record, dict) else []
            pos = _skip_space(text, end)
            if text.startswith(",", pos):
                pos += 1
    else:
        for line in text.split("\n"):
            if len(records) == most:
                break
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue  # blank, not JSON, or the line the read stopped in
            records += [record] if isinstance(record, dict) else []
    return records


def _row_groups(path: str) -> range:
    """The parts a file is read in: its row groups (parquet), or the whole file."""
    if not path.lower().endswith(PARQUET_SUFFIXES):
        return range(1)
    try:
        return range(pq.read_metadata(path).num_row_groups)
    except (OSError, pa.ArrowException) as e:  # (its footer was read at start: changed since)
        raise UnsupportedDataset(f"source.dataset {path} cannot be read: {e}") from None


def _row_id(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def source_field(cfg: SourceConfig) -> str | None:
    """The field of a row that names its `source`: `source`, or source.fields.source."""
    return cfg.fields.source if cfg.fields is not None else "source"


def _source_of(row, field: str | None = "source") -> str:
    source = row.get(field) if isinstance(row, dict) and field is not None else None
    if not isinstance(source, str):
        return ""
    try:
        source.encode()
    except UnicodeEncodeError:  # a lone surrogate: the row is skipped as bad_encoding
        return ""
    return source


def _json_text(row) -> str:
    text = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
    try:
        text.encode()
    except UnicodeEncodeError:  # lone surrogates: keep them as \\ud800 escapes (Arrow needs UTF-8)
        text = json.dumps(row, sort_keys=True, default=str)
    return text


RAW = columns(*RAW_SCHEMA.names)


class TableToRaw(Stage):
    """Rows of a table (any columns) -> raw rows: each row as JSON text."""

    makes = RAW

    def __init__(self, source_field: str | None = "source"):
        self.source_field = source_field  # the field that names a row's source (source.fields.source)

    def apply(self, table: pa.Table) -> pa.Table:
        return _raw_table(table_rows(table, self.source_field))


def table_rows(table: pa.Table, source_field: str | None = "source") -> list[tuple]:
    rows = []
    for row in table.to_pylist():
        raw = _json_text(row)
        rows.append((_row_id(raw), _source_of(row, source_field), raw, "", ""))
    return rows


class FilesToRaw(Stage):
    """Dataset files (jsonl, JSON array, parquet; one file or row group per row) -> raw rows."""

    reads = columns("path", "row_group")
    makes = RAW

    def __init__(self, source_field: str | None = "source"):
        self.source_field = source_field  # the field that names a row's source (source.fields.source)

    def apply(self, batch: pa.Table) -> pa.Table:
        parts = zip(batch.column("path").to_pylist(), batch.column("row_group").to_pylist())
        return _raw_table([row for path, group in parts for row in file_rows(path, group, self.source_field)])


def file_rows(path: str, row_group: int = 0, source_field: str | None = "source") -> list[tuple]:
    """A file's raw rows (a parquet file's: those of `row_group`); where the file cannot be
    read on, the rows before and one bad_file row that names the file and where it broke.
    `source_field`: the field that names a row's source."""
    if path.lower().endswith(PARQUET_SUFFIXES):
        return parquet_rows(path, row_group, source_field)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return [bad_file_row(path, f"cannot be read ({e.strerror or e})")]
    broken = ""
    if data[:2] == b"\x1f\x8b":  # gzip-compressed, whatever the suffix
        data, broken = gunzip(data)
    if data[:3] == b"\xef\xbb\xbf":  # a UTF-8 byte order mark
        data = data[3:]
    is_array = path.lower().endswith((".json", ".json.gz")) and data.lstrip()[:1] == b"["
    if not broken:
        return array_rows(path, data, source_field) if is_array else line_rows(path, data, source_field)
    if is_array:  # the records before the cut, then a bad_json row for the rest
        return array_rows(path, data, source_field) + [bad_file_row(path, broken)]
    complete = data[:data.rfind(b"\n") + 1]  # a line the cut went through is not a row
    line = complete.count(b"\n") + 1
    rows = line_rows(path, complete, source_field)
    return rows + [bad_file_row(f"{path}:{line}", f"{broken}; the {len(rows)} rows before line {line} are kept",
                                data[len(complete):])]


def gunzip(data: bytes) -> tuple[bytes, str]:
    """(the text, "" or why the compressed stream stops early). Decompressed a chunk at a
    time so that a cut or corrupt stream keeps the text before the damage; several gzip
    members one after the other (as `cat a.gz b.gz` makes) are one text."""
    out, pos, chunk = [], 0, 1 << 20
    while pos < len(data):
        d = zlib.decompressobj(wbits=31)
        while not d.eof and pos < len(data):
            piece = data[pos:pos + chunk]
            try:
                out.append(d.decompress(piece))
            except zlib.error as e:
                return b"".join(out), f"corrupt gzip data ({e}) after {pos} compressed bytes"
            pos += len(piece)
        if not d.eof:
            return b"".join(out), (f"truncated gzip file: the compressed stream ends after {len(data)} bytes, "
                                   "before its end marker")
        pos -= len(d.unused_data)  # the next member (or trailing bytes) starts here
        if not data[pos:].strip(b"\x00"):  # trailing zero padding (tape, some writers)
            break
    return b"".join(out), ""


def parquet_rows(path: str, group: int, source_field: str | None = "source") -> list[tuple]:
    """One row group's rows, with the file's own schema; a damaged group is one bad_file row."""
    try:
        parquet = pq.ParquetFile(path)
        return table_rows(parquet.read_row_group(group), source_field)
    except (OSError, pa.ArrowException) as e:
        return [bad_file_row(path, f"row group {group} cannot be read ({e}); the file's other row groups are read")]


def bad_file_row(origin: str, why: str, tail: bytes = b"") -> tuple:
    """One skipped row for the part of a file that cannot be read; `tail`: the bytes of the
    line that was cut, as the row's raw text."""
    raw = tail.decode("utf-8", errors="backslashreplace")
    log.warning("%s: %s", origin, why)
    return (_row_id(f"{origin}\n{raw}"), "", raw, origin, f"bad_file: {why}")


def line_rows(path: str, data: bytes, source_field: str | None = "source") -> list[tuple]:
    """One row per non-blank line, each decoded on its own."""
    rows = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        origin = f"{path}:{number}"
        try:
            text, error = line.decode("utf-8").strip(), ""
        except UnicodeDecodeError as e:
            text = line.decode("utf-8", errors="backslashreplace").strip()
            error = f"bad_encoding: not UTF-8: byte 0x{line[e.start]:02x} at column {e.start + 1}"
        if not text:
            continue  # blank lines are not rows
        source = ""
        if not error:
            try:
                source = _source_of(json.loads(text), source_field)
            except (ValueError, RecursionError):
                pass  # not JSON: skipped later as bad_json
        rows.append((_row_id(text), source, text, origin, error))
    return rows


def array_rows(path: str, data: bytes, source_field: str | None = "source") -> list[tuple]:
    """A `.json` file holding `[record, ...]`: one row per record, decoded one at a time, so
    a record with a bad byte is skipped alone. A file that stops being JSON part way
    through gives one bad_json row for the rest (named by file and line)."""
    # surrogateescape: a bad byte becomes a lone surrogate in the record that holds it.
    text = data.decode("utf-8", errors="surrogateescape")
    decoder = json.JSONDecoder()
    rows = []
    pos = text.index("[") + 1
    line = text.count("\n", 0, pos) + 1
    while True:
        start = _skip_space(text, pos)
        line += text.count("\n", pos, start)
        if start < len(text) and text[start] == "]" and not text[start + 1:].strip():
            return rows
        origin = f"{path}:{line}"
        try:
            record, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError) as e:
            rest = text[start:].encode("utf-8", errors="surrogateescape").decode("utf-8", errors="backslashreplace")
            rows.append((_row_id(rest), "", rest, origin, ""))
            log.warning("%s: not a JSON array from here on (%s); the rest is one bad_json row", origin, e)
            return rows
        chunk = text[start:end]
        try:
            chunk.encode("utf-8")
            raw, error = _json_text(record), ""
        except UnicodeEncodeError as e:
            raw = chunk.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="backslashreplace")
            error = f"bad_encoding: not UTF-8: byte 0x{ord(chunk[e.start]) - 0xDC00:02x}"
        rows.append((_row_id(raw), "" if error else _source_of(record, source_field), raw, origin, error))
        line += text.count("\n", start, end)
        pos = _skip_space(text, end)
        line += text.count("\n", end, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _raw_table(rows: list[tuple]) -> pa.Table:
    columns = list(zip(*rows)) if rows else [[]] * len(RAW_SCHEMA)
    return pa.Table.from_arrays([pa.array(c, pa.string()) for c in columns], schema=RAW_SCHEMA)


def content_stamp(layout: Layout) -> dict[str, list[int]] | None:
    """What identifies a local dataset's content, cheap at any size: every file it reads as
    path -> [size in bytes, modification time in ns] (a save_to_disk folder: every file
    under it). None for a hub dataset: `datasets` serves its cached copy, not checked here."""
    if layout.kind == "hub":
        return None
    files = layout.paths
    if layout.kind == "saved":
        files = [os.path.join(root, n) for root, _, names in _walk(layout.paths[0]) for n in names]
    stamp = {}
    for file in files:
        st = os.stat(file)
        stamp[os.path.abspath(file)] = [st.st_size, st.st_mtime_ns]
    return stamp


def stamp_changes(recorded: dict[str, list[int]], now: dict[str, list[int]], most: int = 5) -> list[str]:
    """What differs between two content stamps, one phrase per file (the first `most`)."""
    changes = [f"{path} added" for path in now if path not in recorded]
    changes += [f"{path} removed" for path in recorded if path not in now]
    for path, (size, mtime) in now.items():
        if path in recorded and [size, mtime] != list(recorded[path]):
            was = recorded[path][0]
            changes.append(f"{path} modified ({was} -> {size} bytes)" if size != was else f"{path} modified (same size)")
    return changes[:most] + ([f"{len(changes) - most} more"] if len(changes) > most else [])
