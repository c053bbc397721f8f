"""The commands README.md gives, read out of its fenced blocks, for the tests that run them
as written (test_readme.py, test_upload.py, test_cluster.py)."""

from __future__ import annotations

import json
import re
import shlex

from support import REPO


def blocks(language: str, text: str | None = None) -> list[str]:
    text = (REPO / "README.md").read_text() if text is None else text
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def commands(text: str | None = None) -> list[list[str]]:
    """Every command line of the README's bash blocks, as argv (continuations joined,
    comments dropped)."""
    found = []
    for block in blocks("bash", text):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                found.append(argv)
    return found


def starting(*prefix: str, text: str | None = None) -> list[list[str]]:
    return [argv for argv in commands(text) if argv[:len(prefix)] == list(prefix)]


def submit_line() -> list[str]:
    [line] = starting("ray", "job", "submit")
    return line


def runtime_env() -> dict:
    """The `--runtime-env-json` of the README's `ray job submit`, parsed."""
    line = submit_line()
    return json.loads(line[line.index("--runtime-env-json") + 1])


def set_examples() -> list[str]:
    """Every `--set KEY=VALUE` the README shows, in commands and in prose."""
    text = (REPO / "README.md").read_text()
    found = [argv[i + 1] for argv in commands() for i, a in enumerate(argv[:-1]) if a == "--set"]
    found += re.findall(r"`--set ([\w.]+=[^`]+)`", text)
    return [f for f in found if f not in PLACEHOLDERS]


PLACEHOLDERS = {"dotted.key=value", "key=value"}
