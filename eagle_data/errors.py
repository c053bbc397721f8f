"""The project's errors, and the one way a command fails with them.

Every error meant for a user is an EagleDataError, defined here: it says what is wrong and
what to do, and carries the exit code the command returns (`exit_code`). The entry points
(`ray_jobs.generate`, `ray_jobs.train_draft`, `python -m eagle_data`) run through `cli`,
which prints `error: <message>` and returns that code instead of a traceback. A stop signal (SIGTERM,
Ctrl-C) is a Stopped, not an error: `cli` prints one line for it too and returns 128 + the
signal's number. Anything else is a bug and keeps its traceback. Subclasses keep the
built-in type a caller may already catch.

The lowest layer: this module imports nothing from the project.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from typing import Callable, Iterator, NoReturn


class EagleDataError(Exception):
    """Base class: a problem the user can act on, with the key, path or row named."""

    exit_code = 2  # a setup or input problem: nothing was started, or what was published is kept


class ConfigError(EagleDataError, ValueError):
    """A config problem, with the offending key named."""


class MissingInput(EagleDataError, FileNotFoundError):
    """A path the job or a tool needs does not exist or holds nothing usable."""


class MissingPackage(EagleDataError, ImportError):
    """An optional package a command needs is not installed (the extra that brings it named)."""


class UnsupportedDataset(MissingInput):
    """source.dataset names files this job cannot read (the file is named)."""


class NotWritable(EagleDataError, PermissionError):
    """output.path (or a tool's destination) cannot be written."""


class NotAnOut(EagleDataError, FileNotFoundError):
    """A path given as an OUT folder is not one."""

    def __init__(self, path: str, why: str = ""):
        super().__init__(f"not an eagle-data OUT: {path}{f' ({why})' if why else ''}")


class OutputLocked(EagleDataError):
    """Another run is writing this OUT: two writers would break exactly-once."""


class ForeignFiles(EagleDataError):
    """output.path holds files the project did not write."""


class UndecodableName(ForeignFiles):
    """A file in OUT whose name is not UTF-8: not a name eagle-data writes."""

    def __init__(self, path: str):
        super().__init__(f"{path} is a file whose name is not UTF-8: eagle-data writes only its own UTF-8 "
                         "names, so it is not a file of this OUT. Nothing was changed; move or rename it")


class DamagedShard(EagleDataError):
    """A tool met a shard that does not read (the job quarantines those at start)."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path} cannot be read ({why}): a damaged shard. Rerun the job with the config "
                         "that made this OUT: it moves the shard to quarantine/ and makes its samples again "
                         "(`python -m eagle_data verify OUT` lists every problem)")
        self.path, self.why = path, why


class OutputMismatch(EagleDataError):
    """OUT was made with a config that the current one would silently mix with."""


class DamagedModel(EagleDataError):
    """A model file does not hold what it says (a truncated download), named."""


class NoReplicaResources(EagleDataError):
    """The cluster cannot hold one engine replica (after engine.resource_wait_s): a setup
    problem like any other, so the same code."""


class DraftStartFailed(EagleDataError):
    """The draft trainer's worker could not build the draft on its verifier (the target's
    config or weights did not load): the cause named, instead of Ray Train's traceback."""


class NoTrainingResources(EagleDataError):
    """The cluster cannot hold the draft trainer's workers (after train.resource_wait_s)."""


class EngineStartFailed(EagleDataError):
    """An engine replica could not start (its model load raised): a setup problem, with the
    root cause and the settings to check, instead of Ray's ActorDiedError traceback."""


class NoSuchSample(EagleDataError, LookupError):
    """`inspect --sample-id` names a sample that OUT/data does not hold."""


class VocabError(EagleDataError, ValueError):
    """A draft vocabulary cannot be built from this OUT with these settings."""


class StageFailed(EagleDataError):
    """A job the pilot ran as one of its stages failed: the job's exit code is the pilot's."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class EmptyResult(EagleDataError):
    """The job made nothing: an empty dataset, or every row skipped. Its own exit code so
    that a pipeline can tell it from a setup error."""

    exit_code = 3


class DiskFull(EagleDataError, OSError):
    """The disk filled up while writing; `cli` makes one from any OSError with ENOSPC."""

    exit_code = 4

    def __init__(self, where: str, cause: OSError):
        super().__init__(f"no space left on device writing {where} ({cause}). What was published "
                         "is kept: free some space and rerun the same command, it resumes.")
        self.errno = errno.ENOSPC


class NotEnoughSpace(EagleDataError):
    """A phase's storage estimate exceeds the free space: refused before it starts."""

    exit_code = 4


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM: `ray job stop`, `kill`; SIGINT: Ctrl-C) raised in the main
    thread, so that the job unwinds as on Ctrl-C: the lock is released and Ray shut down.
    A KeyboardInterrupt, so that no `except Exception` catches it; `cli` exits 128 + its
    number (130, 143), the shell's convention for a process stopped by a signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stopped_by: list[int] = []  # the stop signals received, in order: what `cli` reports


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise Stopped. Called again after ray.init, which replaces the
    SIGTERM handler (Ray's Python ones, and its core worker's C++ failure handler): with
    Ray's, the driver printed a C++ stack and aborted (exit 134). Python runs signal
    handlers in the main thread only, so only there can they be installed."""
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, _stop)


def ignore_stop_signals() -> None:
    """From the first stop signal on: a second one (Ctrl-C twice) would cut the unwinding or
    Ray's shutdown short, with a traceback, and leave Ray's processes running. A handler
    that does nothing rather than SIG_IGN: Ray's DeferSigint calls the handler it finds,
    and child processes would inherit SIG_IGN."""
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, _ignore)


@contextlib.contextmanager
def stop_signals_kept() -> Iterator[None]:
    """Around a call that installs its own SIGTERM handler: the handlers as they were before
    it, after it. Ray's `build_processor` (every vLLM pass builds one) calls
    `ray.init(ignore_reinit_error=True)`, which installs Ray's SIGTERM handler before it
    finds Ray started: a later SIGTERM then raised SystemExit(15), which no `except` of the
    job's took for a stop: exit 15, no `error:` line, the interpreter's slow finalization
    with Ray loaded (issue 63). A SIGTERM while the call runs, met by that handler, is a
    Stopped too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        yield
    except SystemExit as e:
        if e.code != signal.SIGTERM or signal.getsignal(signal.SIGTERM) is saved[signal.SIGTERM]:
            raise
        _stopped_by.append(signal.SIGTERM)
        ignore_stop_signals()
        raise Stopped(signal.SIGTERM) from None
    finally:
        if signal.getsignal(signal.SIGTERM) is not _ignore:  # a stop met meanwhile keeps ignoring further ones
            for s, handler in saved.items():
                if handler is not None:
                    signal.signal(s, handler)


def _stop(signum: int, frame) -> None:
    _stopped_by.append(signum)
    ignore_stop_signals()
    raise Stopped(signum)


def _ignore(signum: int, frame) -> None:
    pass


def stop_signal(e: KeyboardInterrupt) -> int:
    """The stop signal behind `e`: its own number, also where what came is a plain
    KeyboardInterrupt (a stop raised inside a call that turned it into one); Ctrl-C before
    the handlers were installed."""
    return getattr(e, "signum", None) or (_stopped_by[0] if _stopped_by else signal.SIGINT)


def user_error(e: BaseException | None) -> EagleDataError | None:
    """The project's error behind `e`, if any: `e` itself, or what it wraps through a Ray
    task's or actor's error (its `.cause`) or was raised from."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        if isinstance(e, EagleDataError) and not isinstance(cause, BaseException):
            return e
        e = cause if isinstance(cause, BaseException) else e.__cause__
    return None


def no_space(e: BaseException) -> OSError | None:
    """The OSError with errno ENOSPC behind `e`, if any. Looked for by errno, not text, through
    a Ray task's error (its `.cause`) and what `e` was raised from or while handling."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return None


def cli(command: Callable[[], int], writing: Callable[[], str | None] = lambda: None, on_stop: str = "") -> int:
    """Run a command and return its exit code. A user error prints `error: <message>` on
    stderr and returns the error's exit_code; a full disk while writing `writing()` (OUT or a
    destination) is a DiskFull; a stop signal (Stopped, or Ctrl-C before stop_on_signals)
    prints `error: stopped by SIG...<on_stop>` and returns 128 + its number. Anything else
    propagates with its traceback."""
    _stopped_by.clear()  # a stop signal is one per command: an earlier command's is not this one's
    try:
        try:
            return command()
        except EagleDataError:
            raise
        except Exception as e:
            cause = no_space(e)
            if cause is None:
                raise
            raise DiskFull(writing() or "the output", cause) from e
    except EagleDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        ignore_stop_signals()  # the process is on its way out: no second message or traceback
        signum = stop_signal(e)
        print(f"error: stopped by {signal.Signals(signum).name}{on_stop}", file=sys.stderr)
        return 128 + signum


def exit_with(code: int) -> NoReturn:
    """The entry points' exit. After a stop signal at once, without the interpreter's
    finalization: with Ray loaded it takes seconds (`ray job stop` SIGKILLs 3 s after its
    SIGTERM), and Python puts the default handlers back in it, so a Ctrl-C pressed again
    then would kill the process with another status than the one `cli` returned."""
    if code - 128 in STOP_SIGNALS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
