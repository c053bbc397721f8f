"""Every path of this repository that README.md, docs/*.md, configs/*.yaml and cluster.yaml
name exists, so that the docs cannot go on citing a file that was moved or deleted.

What is checked: a path that starts with one of the repository's top folders
(`eagle_data/job/stages/engines/state_files.py`, `tests/vllm/`, `benchmarks/server_vs_job.py`);
a path that starts with a folder of eagle_data/, which the docs name relative to it
(`job/stages/feed.py`, `engines/state_files.py`, `storage/`); a dotted module name
(`python -m ray_jobs.generate`), which may end in a name that module defines
(`eagle_data.training.stream.features`, `storage/contract.PHASES`, a class's
`eagle_data.storage.status.SampleStatus.read`); a Markdown link's target,
relative to the file it is in. Each must be a file or a folder (a module: its .py file or
package) of this checkout.

What is left out, each by one rule:
- URLs: their paths are another site's.
- A path inside another one (after `/`, `.`, `-` or a letter): `OUT/data/`, `out/demo/data/`,
  `~/x/docs/`, vLLM's `vllm/v1/...` are not paths of this repository.
- `data/` outside `data/sample/`: the repository's data/ holds only the bundled sample; every
  other `data/` the docs write is OUT's folder (`data/`, `data/*.parquet`) or a user's file.
- Patterns: a path with `*`, `<...>` or `{...}` names no one file; only its folders before
  the first wildcard are checked (`tests/vllm/*.py`: `tests/vllm/`). Placeholders are written
  in angle brackets (`ray_jobs.<name>`).
- Prose: a `word/word` with no suffix, no trailing slash and no deeper part may be two words
  (robustness.md's `docs/hidden files`: docs or hidden files); write a folder with its
  trailing slash (`tests/vllm/`) to have it checked.
- Someone else's files: a path right after a possessive belongs to whoever is named
  (SpecForge's `scripts/regenerate_train_data.py`, speculators' `scripts/train.py`, a user's
  `data/train.jsonl`).
- A dotted name that the code spells as a string is a key, not a module (the shard footer's
  `eagle_data.out_id`, storage/contract.py): it is checked to be in the code.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from support import REPO

TOP = ("eagle_data", "ray_jobs", "tests", "benchmarks", "scripts", "configs", "docs", "data")
PACKAGES = ("eagle_data", "ray_jobs")
# The folders inside eagle_data/ (job, stages, engines, storage, ...) by name: a path the docs
# start with one of them is relative to the folder that holds it (to any, where several do).
INNER: dict[str, list[Path]] = {}
for folder in sorted((REPO / "eagle_data").rglob("*")):
    if folder.is_dir() and folder.name != "__pycache__":
        INNER.setdefault(folder.name, []).append(folder.parent)

PATH_CHARS = r"[\w./*<>{}-]"
NOT_AFTER = r"(?<![\w./-])"  # not inside another path, word or file name
TOP_PATH = re.compile(NOT_AFTER + rf"((?:{'|'.join(TOP)})/{PATH_CHARS}*)")
INNER_PATH = re.compile(NOT_AFTER + rf"((?:{'|'.join(sorted(INNER))})/{PATH_CHARS}*)")
MODULE = re.compile(NOT_AFTER + rf"((?:{'|'.join(PACKAGES)})(?:\.\w+)+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
WILDCARD = re.compile(r"[*<>{}]")
POSSESSIVE = re.compile(r"(?:'s|s')\s+`?$")


def sources() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "configs").glob("*.yaml")),
            REPO / "cluster.yaml"]


def bound_names(statements: list[ast.stmt]) -> set[str]:
    """The names a module's or a class's body binds (also under an if/try/with in it)."""
    names, body = set(), list(statements)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body.extend([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                         *(s for h in getattr(node, "handlers", []) for s in h.body)])
    return names


@functools.cache
def parsed(module_file: Path) -> ast.Module:
    return ast.parse(module_file.read_text())


def defines(module_file: Path, names: list[str]) -> bool:
    """NAME: the module binds it, or exports it lazily (a string of its source, as a module
    `__getattr__` takes it), or it is a module's own (`__file__`); Class.NAME: the class's
    body binds it."""
    tree = parsed(module_file)
    if len(names) == 1:
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        return names[0] in bound_names(tree.body) | strings or re.fullmatch(r"__\w+__", names[0]) is not None
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == names[0]]
    return len(names) == 2 and any(names[1] in bound_names(c.body) for c in classes)


@functools.cache
def code_strings() -> set[str]:
    """Every string constant in the packages' code."""
    return {n.value for package in PACKAGES for f in (REPO / package).rglob("*.py")
            for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def module_file(parts: list[str]) -> Path | None:
    """The file of module a.b.c (a/b/c.py, or a/b/c/__init__.py; a package folder without one)."""
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return base if base.is_dir() else None


def module_exists(name: str) -> bool:
    """A module, or a module and a name it defines (`defines`), or a string the code holds."""
    parts = name.split(".")
    if module_file(parts) is not None or name in code_strings():
        return True
    for split in (len(parts) - 1, len(parts) - 2):
        found = module_file(parts[:split]) if split > 0 else None
        if found is not None and found.is_file() and defines(found, parts[split:]):
            return True
    return False


def path_exists(path: Path) -> bool:
    """A file or folder; or `x/module.NAME`: module.py defining NAME (`defines`)."""
    if path.exists():
        return True
    stem, dot, names = path.name.partition(".")
    module = path.with_name(stem + ".py")
    return bool(dot) and module.is_file() and all(n.isidentifier() for n in names.split(".")) \
        and defines(module, names.split("."))


def checked_path(path: str) -> str | None:
    """The part of a matched path to check, or None when the rules above leave it out."""
    path = path.rstrip(".")
    wildcard = WILDCARD.search(path)
    if wildcard:
        path = path[:wildcard.start()].rpartition("/")[0] + "/"
    if path.startswith("data/") and not path.startswith("data/sample/"):
        return None
    if path.count("/") == 1 and not path.endswith("/") and "." not in path.split("/")[1]:
        return None  # `docs/hidden files`: maybe prose
    return path


def missing_paths(file: Path, text: str | None = None) -> list[str]:
    """`file:line: what` for each path the file (or text, as if it were that file's) names
    that is not in the checkout."""
    missing = []
    relative = file.relative_to(REPO)
    for number, raw in enumerate((file.read_text() if text is None else text).splitlines(), 1):
        line = URL.sub(" ", raw)
        where = f"{relative}:{number}"

        def someone_elses(match: re.Match) -> bool:
            return bool(POSSESSIVE.search(line[:match.start()]))

        for match in TOP_PATH.finditer(line):
            path = checked_path(match.group(1))
            if path and not someone_elses(match) and not path_exists(REPO / path):
                missing.append(f"{where}: {path}")
        for match in INNER_PATH.finditer(line):
            path = checked_path(match.group(1))
            if path and not someone_elses(match) and not any(path_exists(parent / path)
                                                             for parent in INNER[path.split("/")[0]]):
                missing.append(f"{where}: {path} (in eagle_data/)")
        for match in MODULE.finditer(line):
            if not module_exists(match.group(1)):
                missing.append(f"{where}: {match.group(1)} (a module, or a name in one)")
        if file.suffix == ".md":
            for match in LINK.finditer(raw):
                target = match.group(1).partition("#")[0]
                if target and "://" not in target and not target.startswith("mailto:") \
                        and not (file.parent / target).exists():
                    missing.append(f"{where}: {target} (a link)")
    return missing


def test_every_path_the_docs_name_exists():
    missing = [m for f in sources() for m in missing_paths(f)]
    assert not missing, "paths named in the docs that are not in the repository:\n" + "\n".join(missing)


def test_the_rules_find_what_they_should():
    """The scanner on lines of the kinds above: what it checks, and what it leaves out."""
    def found(text: str) -> list[str]:
        return [m.split(": ", 1)[1] for m in missing_paths(REPO / "docs" / "x.md", text)]

    assert found("see eagle_data/engines/vllm_backend.py.") == ["eagle_data/engines/vllm_backend.py"]
    assert found("`benchmarks/nope.py --smoke`, engines/nope.py") == ["benchmarks/nope.py",
                                                                       "engines/nope.py (in eagle_data/)"]
    assert found("python -m ray_jobs.nope; eagle_data.training.stream.nope") == [
        "ray_jobs.nope (a module, or a name in one)", "eagle_data.training.stream.nope (a module, or a name in one)"]
    assert found("[x](nope.md) [y](performance.md#5-the-job) [z](https://example.com/docs/nope.md)") == [
        "nope.md (a link)"]
    # what exists, and what the rules leave out
    assert found("eagle_data/job/stages/engines/state_files.py, `tests/vllm/`, job/stages/feed.py, "
                 "storage/contract.PHASES, eagle_data.training.stream.features, python -m ray_jobs.generate, "
                 "eagle_data.out_id, eagle_data.reader.OutIterableDataset, eagle_data.storage.status.SampleStatus.read, "
                 "storage/status.SampleStatus.read") == []
    assert found("eagle_data.storage.status.SampleStatus.nope, eagle_data.stream.features") == [
        "eagle_data.storage.status.SampleStatus.nope (a module, or a name in one)",
        "eagle_data.stream.features (a module, or a name in one)"]
    assert found("OUT/data/x.parquet out/demo/docs/nope.md https://github.com/o/r/blob/main/tests/nope.py") == []
    assert found("data/*.parquet, data/train.jsonl, tests/nope/*.py, ray_jobs.<name>, docs/hidden files") == [
        "tests/nope/"]
    assert found("SpecForge's `scripts/nope.py`, speculators' scripts/nope.py, a user's `data/x.jsonl`") == []

