"""storage/files.py: the one atomic write (write aside, then move into place) and the one
filesystem resolver, on a local folder and on an fsspec memory:// filesystem."""

from __future__ import annotations

import os
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from eagle_data.storage.contract import STAGING, is_ours
from eagle_data.storage.files import filesystem, read_json, write_atomically, write_bytes, write_json
from eagle_data.storage.shards import publish_table, shard_files


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    """(filesystem, OUT root in it, the URI or path a user gives) on each kind of storage."""
    if request.param == "local":
        yield (*filesystem(str(tmp_path / "out")), str(tmp_path / "out"))
        return
    import fsspec

    uri = f"memory://eagle-files-{uuid.uuid4().hex}/out"
    fs, path = filesystem(uri)
    yield fs, path, uri
    fsspec.filesystem("memory").rm(path.rsplit("/", 1)[0], recursive=True)


def files_under(fs, folder: str) -> list[str]:
    found = fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True))
    return sorted(f.path[len(folder) + 1:] for f in found if f.is_file)


def read_bytes(fs, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def half_write_then_fail(fs, seen: list[str]):
    def write(tmp: str) -> None:
        seen.append(tmp)
        with fs.open_output_stream(tmp) as f:
            f.write(b"half of it")
        raise OSError("disk full")
    return write


@pytest.mark.parametrize("in_staging", [True, False])
def test_a_failed_write_leaves_no_destination_and_no_temp_file(root, in_staging):
    fs, out, _ = root
    dest = f"{out}/vocab/d2t.npy"
    seen: list[str] = []
    with pytest.raises(OSError, match="disk full"):
        write_atomically(fs, dest, half_write_then_fail(fs, seen),
                         staging=f"{out}/{STAGING}" if in_staging else None)
    assert seen and not fs.get_file_info(seen[0]).is_file
    assert files_under(fs, out) == []


def test_a_failed_overwrite_keeps_the_old_file(root):
    fs, out, _ = root
    dest = f"{out}/report.html"
    write_bytes(fs, dest, b"old report", staging=f"{out}/{STAGING}")
    with pytest.raises(OSError):
        write_atomically(fs, dest, half_write_then_fail(fs, []), staging=f"{out}/{STAGING}")
    assert read_bytes(fs, dest) == b"old report"
    assert files_under(fs, out) == ["report.html"]


@pytest.mark.parametrize("in_staging", [True, False])
def test_overwrite_replaces_the_whole_file(root, in_staging):
    fs, out, _ = root
    staging = f"{out}/{STAGING}" if in_staging else None
    dest = f"{out}/vocab/vocab.json"
    write_bytes(fs, dest, b"a much longer first version", staging)
    write_bytes(fs, dest, b"second", staging)
    assert read_bytes(fs, dest) == b"second"
    assert [f for f in files_under(fs, out) if not f.startswith(STAGING)] == ["vocab/vocab.json"]
    assert files_under(fs, f"{out}/{STAGING}") == []


def test_a_killed_write_leaves_only_a_file_nothing_reads(root):
    """While the temporary file exists (all a kill -9 can leave), the destination does not,
    the temporary file is one the project may delete, and no reader or resume lists it."""
    fs, out, _ = root
    table = pa.table({"x": [1, 2, 3]})
    seen = []

    def write(tmp: str) -> None:
        import pyarrow.parquet as pq

        pq.write_table(table, tmp, filesystem=fs)
        seen.append(tmp)
        assert not fs.get_file_info(dest).is_file
        assert is_ours(tmp[len(out) + 1:])
        assert shard_files(fs, dest.rsplit("/", 1)[0]) == []  # a resume or reader lists none

    dest = f"{out}/data/part-20250101T000000-abcdef-00000.parquet"
    write_atomically(fs, dest, write, staging=f"{out}/{STAGING}")
    dest = f"{out}/vocab/token_freq.parquet"
    write_atomically(fs, dest, write)  # beside the destination, hidden
    assert [tmp.rsplit("/", 1)[1].startswith(".") for tmp in seen] == [False, True]
    assert shard_files(fs, f"{out}/data") == [f"{out}/data/part-20250101T000000-abcdef-00000.parquet"]


def test_publish_table_and_json_round_trip(root):
    import pyarrow.parquet as pq

    fs, out, uri = root
    table = pa.table({"x": [1, 2, 3]})
    path = publish_table(fs, out, "data", "part-20250101T000000-abcdef-00000.parquet", table)
    write_json(fs, f"{out}/manifest.json", {"phases": {}})
    # A second resolution of the same URI sees what the first wrote.
    fs2, out2 = filesystem(uri)
    assert out2 == out
    with fs2.open_input_file(path) as f:
        assert pq.read_table(f).equals(table)
    assert read_json(fs2, f"{out}/manifest.json") == {"phases": {}}
    assert files_under(fs2, out) == ["data/part-20250101T000000-abcdef-00000.parquet", "manifest.json"]


def test_resolver_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = filesystem("out")
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(tmp_path / "out")
    assert filesystem("~/x")[1] == os.path.expanduser("~/x")
    assert filesystem(f"file://{tmp_path}/out/")[1] == str(tmp_path / "out")


def test_resolver_memory_uri_and_given_filesystems():
    import fsspec

    fs, path = filesystem("memory://eagle-files-given/out/")
    assert isinstance(fs, pafs.PyFileSystem) and path == "/eagle-files-given/out"
    mem = fsspec.filesystem("memory")
    try:
        write_bytes(fs, f"{path}/a.txt", b"written through pyarrow")
        assert mem.cat("/eagle-files-given/out/a.txt") == b"written through pyarrow"
        given, p = filesystem("/eagle-files-given/out", mem)  # an fsspec filesystem object
        assert read_bytes(given, f"{p}/a.txt") == b"written through pyarrow"
        local = pafs.LocalFileSystem()
        assert filesystem("/some/where/", local) == (local, "/some/where")
    finally:
        mem.rm("/eagle-files-given", recursive=True)


def test_the_job_output_opens_an_fsspec_uri_the_reader_reads(root):
    """The job's Output and the reader's OutReader resolve the same URIs the same way."""
    from eagle_data.reader import OutReader
    from eagle_data.storage.folder import Output

    fs, out, uri = root
    job = Output(uri)
    assert job.root == out and type(job.fs) is type(fs)
    job.check_writable()
    job.manifest.save()
    assert OutReader(uri).root == out and OutReader(uri).files == []


def not_regular_things(folder) -> dict:
    """{kind: path} of every non-regular thing a user may have at a name a tool writes:
    a FIFO, a symlink to a file, a dangling symlink, a folder, and (as root) a device node
    like /dev/null. Made fresh for each test; `.../target` is the symlink's file."""
    import stat

    os.makedirs(folder)
    target = os.path.join(folder, "target")
    with open(target, "w") as f:
        f.write("the user's file\n")
    things = {"FIFO": os.path.join(folder, "fifo"), "symlink": os.path.join(folder, "link"),
              "dangling symlink": os.path.join(folder, "dangling"), "folder": os.path.join(folder, "dir")}
    os.mkfifo(things["FIFO"])
    os.symlink(target, things["symlink"])
    os.symlink(os.path.join(folder, "nowhere"), things["dangling symlink"])
    os.mkdir(things["folder"])
    if os.geteuid() == 0:  # mknod of a device needs root: the /dev/null of the issue
        things["character device"] = os.path.join(folder, "null")
        os.mknod(things["character device"], 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return things


def snapshot(path: str) -> tuple:
    """What is at `path`, without following a symlink: its type, link target, and content."""
    st = os.lstat(path)
    return (st.st_mode, st.st_rdev, os.readlink(path) if os.path.islink(path) else None,
            open(os.path.join(os.path.dirname(path), "target")).read())


@pytest.mark.parametrize("in_staging", [True, False])
def test_only_regular_files_are_replaced(tmp_path, in_staging):
    """The issue: `export OUT x` over a device node made `x` a regular file (as root, over
    /dev/null, for the whole machine). Anything but a regular file is refused, named, and left
    as it was; a regular file is still replaced."""
    from eagle_data.errors import NotWritable

    fs, folder = filesystem(str(tmp_path / "things"))
    things = not_regular_things(folder)
    staging = f"{folder}/{STAGING}" if in_staging else None
    for kind, path in things.items():
        before = snapshot(path)
        with pytest.raises(NotWritable, match=f"{path} is an? {kind.removeprefix('dangling ')}"):
            write_bytes(fs, path, b"written", staging)
        assert snapshot(path) == before, kind
    write_bytes(fs, f"{folder}/target", b"replaced", staging)
    assert read_bytes(fs, f"{folder}/target") == b"replaced"
    assert not [n for n in os.listdir(folder) if n.startswith(".") and n != STAGING]  # no temporary file left
    assert not in_staging or os.listdir(staging) == []


def test_a_thing_that_appears_during_the_write_is_not_replaced(tmp_path):
    """Checked again just before the move: a FIFO made while the file was written stays."""
    from eagle_data.errors import NotWritable

    fs, folder = filesystem(str(tmp_path))
    dest = f"{folder}/report.html"

    def write(tmp: str) -> None:
        with fs.open_output_stream(tmp) as f:
            f.write(b"report")
        os.mkfifo(dest)

    with pytest.raises(NotWritable, match="is a FIFO"):
        write_atomically(fs, dest, write)
    assert stat_is_fifo(dest) and os.listdir(folder) == ["report.html"]


def stat_is_fifo(path: str) -> bool:
    import stat

    return stat.S_ISFIFO(os.lstat(path).st_mode)
