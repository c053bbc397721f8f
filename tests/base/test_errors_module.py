"""One way to fail: every user error lives in eagle_data.errors with its exit code, both
entry points print it through `errors.cli` with one prefix, and a bug keeps its traceback."""

from __future__ import annotations

import ast
import errno
import importlib
import inspect
import os
import pkgutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pytest

import eagle_data
import ray_jobs
from support import REPO
from eagle_data import errors
from eagle_data.__main__ import TOOLS
from eagle_data.errors import DiskFull, EagleDataError, EmptyResult, cli
from eagle_data.job.stages.columns import MissingColumns, require

# The entry points (every module of ray_jobs/, and the tools' command line), and the
# functions in them that make the exit code.
ENTRY_POINTS = {"ray_jobs/generate.py": {"main", "job"}, "ray_jobs/train_draft.py": {"main", "job"},
                "ray_jobs/acceptance.py": {"main", "job"}, "ray_jobs/pilot.py": {"main", "job"},
                "eagle_data/__main__.py": {"main"}}
CLI = {**ENTRY_POINTS, **{tool.__name__.replace(".", "/") + ".py": {"run_cli"} for tool in TOOLS}}
VERIFY_FOUND_PROBLEMS = 1  # a result of `verify`, not an error


def user_errors() -> set[type]:
    """Every EagleDataError subclass, once every module of the package is imported."""
    for module in pkgutil.walk_packages(eagle_data.__path__, "eagle_data."):
        importlib.import_module(module.name)
    for module in pkgutil.walk_packages(ray_jobs.__path__, "ray_jobs."):
        importlib.import_module(module.name)
    found, todo = set(), [EagleDataError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found and not sub.__module__.startswith("ray."):  # Ray's RayTaskError(...) twins
                found.add(sub)
                todo.append(sub)
    return found


def test_every_user_error_lives_in_the_errors_module_with_an_exit_code():
    classes = user_errors()
    assert {c.__module__ for c in classes} == {"eagle_data.errors"}
    defined = {c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, EagleDataError)}
    assert classes | {EagleDataError} == defined
    assert all(isinstance(c.exit_code, int) and c.exit_code >= 2 for c in defined)
    assert {c.exit_code for c in defined} == {2, 3, 4}
    assert (EagleDataError.exit_code, EmptyResult.exit_code, DiskFull.exit_code) == (2, 3, 4)
    assert not issubclass(MissingColumns, EagleDataError)  # a wiring bug, not a user error


def test_the_errors_module_imports_nothing_from_the_project():
    tree = ast.parse((REPO / "eagle_data" / "errors.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not [n for n in names if n.startswith(("eagle_data", "ray_jobs"))]


def returned_ints(path: str, functions: set[str]) -> set[int]:
    ints = set()
    for fn in ast.walk(ast.parse((REPO / path).read_text())):
        if isinstance(fn, ast.FunctionDef) and fn.name in functions:
            for ret in ast.walk(fn):
                if isinstance(ret, ast.Return) and ret.value is not None:
                    ints |= {c.value for c in ast.walk(ret.value)
                             if isinstance(c, ast.Constant) and type(c.value) is int}
    return ints


def test_every_failing_exit_code_comes_from_an_error_type():
    literal = set().union(*(returned_ints(path, fns) for path, fns in CLI.items()))
    assert literal <= {0, VERIFY_FOUND_PROBLEMS}, literal  # the others are exit_code attributes
    # One printer: nothing but errors.cli prints `error: ...`.
    printers = [str(p.relative_to(REPO)) for p in [*(REPO / "eagle_data").rglob("*.py"), *(REPO / "ray_jobs").rglob("*.py")]
                if 'print(f"error: ' in p.read_text()]
    assert printers == ["eagle_data/errors.py"]
    # README's "Exit codes" line names each code.
    readme = (REPO / "README.md").read_text().split("Exit codes: ", 1)[1].split("\n\n", 1)[0]
    assert readme.startswith("0 done;")
    for code in {c.exit_code for c in user_errors()}:
        assert f"; {code} " in readme.replace("\n", " ")


def test_every_entry_point_exits_through_errors_cli():
    """Each module of ray_jobs/ is an entry point listed above; each entry point's main
    installs the stop-signal handlers, returns errors.cli(...)'s code, and the module runs
    `exit_with(main())`."""
    jobs = {f"ray_jobs/{m.name}.py" for m in pkgutil.iter_modules(ray_jobs.__path__)}
    assert jobs == {path for path in ENTRY_POINTS if path.startswith("ray_jobs/")}
    for path in ENTRY_POINTS:
        tree = ast.parse((REPO / path).read_text())
        [main] = [fn for fn in tree.body if isinstance(fn, ast.FunctionDef) and fn.name == "main"]
        calls = {c.func.id for c in ast.walk(main) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        assert "stop_on_signals" in calls, path
        returns = [r.value for r in main.body if isinstance(r, ast.Return)]
        assert [ast.unparse(r.func) for r in returns if isinstance(r, ast.Call)] == ["cli"], path
        [guard] = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"]
        assert [ast.unparse(n) for n in guard.body] == ["exit_with(main())"], path


def test_cli_prints_a_user_error_with_one_prefix_and_returns_its_code(capsys):
    def empty():
        raise EmptyResult("0 prompts: every row skipped")

    assert cli(empty) == 3
    assert capsys.readouterr().err == "error: 0 prompts: every row skipped\n"
    assert cli(lambda: 0) == 0 and capsys.readouterr().err == ""


def test_a_full_disk_is_found_by_errno_and_exits_4(capsys):
    def full():
        raise OSError(errno.ENOSPC, "Error writing bytes to file")  # pyarrow's words, not "No space..."

    assert cli(full, writing=lambda: "/mnt/out") == DiskFull.exit_code == 4
    err = capsys.readouterr().err
    assert err.startswith("error: no space left on device writing /mnt/out (")
    assert "What was published is kept: free some space and rerun the same command, it resumes." in err
    assert err.count("\n") == 1 and "Traceback" not in err

    def words_only():
        raise OSError("No space left on device")

    with pytest.raises(OSError) as e:  # the words without the errno are not matched: a traceback
        cli(words_only)
    assert e.value.errno is None and not isinstance(e.value, EagleDataError)


def test_a_full_disk_inside_a_ray_task_is_found_through_its_cause(capsys):
    from ray.exceptions import RayTaskError

    remote = RayTaskError("write", "Traceback (most recent call last): ...",
                          OSError(errno.ENOSPC, "No space left on device")).as_instanceof_cause()

    def job():
        raise remote

    assert cli(job, writing=lambda: "out") == 4
    err = capsys.readouterr().err
    assert err.startswith("error: no space left on device writing out ([Errno 28] No space left on device)")


def test_a_wiring_bug_propagates_through_cli_with_its_traceback(capsys):
    batch = pa.table({"prompt": ["hi"]})
    with pytest.raises(MissingColumns, match=r"turn stage requires columns \['messages'\]"):
        cli(lambda: require("turn stage", batch, ["messages"]))
    assert capsys.readouterr().err == ""
    code = ("import pyarrow as pa; from eagle_data.errors import cli; from eagle_data.job.stages.columns import require; "
            "cli(lambda: require('turn stage', pa.table({'prompt': ['hi']}), ['messages']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr
    assert "MissingColumns: turn stage requires columns ['messages']" in result.stderr
    assert "error: " not in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_exits_128_plus_its_number_with_one_line(capsys, own_signal_handlers, signum):
    from eagle_data.errors import stop_on_signals

    def job():
        stop_on_signals()
        os.kill(os.getpid(), signum)  # delivered to this (the main) thread at the next bytecode
        time.sleep(5)
        return 0

    assert cli(job, on_stop="; what was published is kept") == 128 + signum
    assert capsys.readouterr().err == f"error: stopped by {signal.Signals(signum).name}; what was published is kept\n"
    # Further stop signals are ignored, so that the shutdown that follows cannot be cut short.
    for again in (signal.SIGINT, signal.SIGTERM):
        os.kill(os.getpid(), again)
        time.sleep(0.1)  # a handler that raised would raise here
    assert capsys.readouterr().err == ""


def test_ctrl_c_before_the_handlers_are_installed_is_a_stop_too(capsys, own_signal_handlers):
    def job():
        raise KeyboardInterrupt  # Python's own SIGINT handler: before the job installs its own

    assert cli(job) == 130
    assert capsys.readouterr().err == "error: stopped by SIGINT\n"


def test_the_tools_stop_on_sigterm_with_one_line_too(capsys, monkeypatch, own_signal_handlers):
    """A tool stopped by SIGTERM unwinds (export removes what it wrote aside) and exits 143."""
    import eagle_data.__main__ as tools

    def stopped(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return 0

    monkeypatch.setattr(tools.verify, "run_cli", stopped)
    assert tools.main(["verify", "some-out"]) == 143
    assert capsys.readouterr().err == "error: stopped by SIGTERM\n"


@pytest.mark.parametrize("code, finalized", [(143, False), (130, False), (2, True), (0, True)])
def test_after_a_stop_the_process_exits_without_the_interpreters_finalization(code, finalized):
    """Seconds with Ray loaded, and a Ctrl-C in it would meet Python's default handlers again."""
    script = f"import atexit; from eagle_data.errors import exit_with; atexit.register(print, 'finalized'); exit_with({code})"
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == code and ("finalized" in result.stdout) == finalized, result
