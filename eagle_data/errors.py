"""The project's errors. Each says what is wrong and what to do; the entry points
(`ray_jobs.generate`, `python -m eagle_data`) print the message and exit non-zero instead
of a traceback. Subclasses keep the built-in type a caller may already catch."""

from __future__ import annotations


class EagleDataError(Exception):
    """Base class: a problem the user can act on, with the key, path or row named."""


class MissingInput(EagleDataError, FileNotFoundError):
    """A path the job or a tool needs does not exist or holds nothing usable."""


class NotWritable(EagleDataError, PermissionError):
    """output.path (or a tool's destination) cannot be written."""


class NotAnOut(EagleDataError, FileNotFoundError):
    """A path given as an OUT folder is not one."""

    def __init__(self, path: str, why: str = ""):
        super().__init__(f"not an eagle-data OUT: {path}{f' ({why})' if why else ''}")


class EmptyResult(EagleDataError):
    """The job made nothing: an empty dataset, or every row skipped. Its own exit code
    (EXIT_CODE) so that a pipeline can tell it from a setup error."""

    EXIT_CODE = 3
