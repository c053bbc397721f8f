"""The pilot (`python -m ray_jobs.pilot`, docs/pilot.md): data recipes compared on the user's
own target before the big run, each stage the project's own job as a user runs it.

    pilot.recipes, each = the config with a few keys changed
      -> per recipe, in pilot.path/recipes/<name>/:
           generate   `python -m ray_jobs.generate`: its prompts (the config's seeded sample
                      of source.*, the same for every recipe that keeps source.*), its answers
                      (or the dataset's), and with train.source hidden_states their features
           train      `python -m ray_jobs.train_draft`: its draft, with the config's `train:`
                      section (the same seed and steps for every recipe), step-<N>/ checkpoints
                      at pilot.measure_steps
      -> acceptance   `python -m ray_jobs.acceptance` once over every draft (each recipe's final
                      and its measured checkpoints) and the target alone, on pilot.held_out
      -> report       pilot_report.py: tau per recipe and source with intervals, the paired
                      differences, tau by step, what each recipe cost

Every stage is a child process on the pilot's Ray instance (the cluster's under `ray job
submit`, else one the pilot starts), so that it resumes as that job does. pilot.json records
each stage's settings and, once it has finished, its time: a rerun skips the finished stages
and runs the rest (an interrupted job resumes itself); a stage whose settings changed since it
ran is refused, naming the keys. A child gets SIGTERM when the pilot dies (PR_SET_PDEATHSIG),
and a rerun waits for one still stopping before it starts its own.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from eagle_data.config import Config
from eagle_data.evaluation.pilot_stages import Stage, changed_keys, stages
from eagle_data.errors import ConfigError, ForeignFiles, NotWritable, StageFailed

log = logging.getLogger("eagle_data")

STATE = "pilot.json"
# What pilot.path holds: the pilot's own files and folders (anything else is not its to touch).
OWN = {STATE, ".pilot.json.tmp", "recipes", "held-out", "acceptance", "report.json", "report.png",
       ".report.json.tmp", ".report.png.tmp.png", "acceptance.yaml", "acceptance.log"}
# How long a rerun waits for a stage's process that an earlier pilot left stopping.
LEFTOVER_WAIT_S = 60
PR_SET_PDEATHSIG = 1


class State:
    """pilot.json: each stage's settings (recorded when it first starts) and, once it has
    finished, its seconds; the stage's process while it runs."""

    def __init__(self, root: Path):
        self.path = root / STATE
        self.data = {"made_by": "eagle-data's pilot (python -m ray_jobs.pilot)", "stages": {}}
        if self.path.exists():
            try:
                self.data = json.loads(self.path.read_text())
                assert isinstance(self.data.get("stages"), dict)
            except (ValueError, AssertionError, AttributeError):
                raise ForeignFiles(f"{self.path} is not the pilot's record (it does not read as one): give "
                                   "another pilot.path") from None

    def stage(self, name: str) -> dict:
        return self.data["stages"].setdefault(name, {})

    def save(self) -> None:
        tmp = self.path.with_name(".pilot.json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


def check_folder(root: Path | str) -> None:
    """pilot.path is new, empty or the pilot's own (its pilot.json and folders only)."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise NotWritable(f"pilot.path {root} is a file: give a folder")
    if root.is_dir():
        names = set(os.listdir(root))
        if names and STATE not in names or names - OWN:
            foreign = sorted(names - OWN) or sorted(names)
            raise ForeignFiles(f"pilot.path {root} holds files the pilot did not write ({', '.join(foreign[:5])}): "
                               "choose an empty or new folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".pilot.json.tmp"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise NotWritable(f"pilot.path {root} cannot be written ({type(e).__name__}: {e.strerror or e})") from None


def refuse_changes(planned: list[Stage], state: State) -> None:
    """A stage that finished with other settings than today's config gives it is refused, with
    the keys: its OUT or draft holds what the old ones made, and the pilot would not run it
    again. (A stage that has not finished runs again, and its job refuses what it cannot
    resume with: the generate job a changed config on its OUT, the trainer another run's
    save_path.) The acceptance stage may measure more drafts (a recipe added): its job keeps
    the passes it finished."""
    for stage in planned:
        recorded = state.data["stages"].get(stage.name, {})
        if not recorded.get("done"):
            continue
        recorded = recorded["config"]
        ignore = ("acceptance.drafts",) if stage.name == "acceptance" else ("acceptance.", )
        keys = changed_keys(recorded, stage.config, ignore)
        if keys:
            raise ConfigError(f"pilot: stage {stage.name} ran with other settings than the config gives now "
                              f"({'; '.join(keys[:6])}{'; ...' if len(keys) > 6 else ''}): set them back, or give "
                              f"a new pilot.path (the stage's output in {stage.folder} was made with the old ones)")


def run_pilot(cfg: Config, env: dict) -> dict:
    """Every stage not finished yet, in order, each its job in a child process with `env` (the
    Ray instance to join); returns each stage's record. pilot.json says what is done."""
    planned = stages(cfg)
    root = Path(cfg.pilot.path)
    check_folder(root)
    state = State(root)
    refuse_changes(planned, state)
    wait_for_leftover(state)
    state.save()  # the folder is the pilot's from now on
    for record in state.data["stages"].values():
        record.pop("ran_now", None)
    for stage in planned:
        record = state.stage(stage.name)
        if record.get("done") and record.get("config") == stage.config:
            log.info("pilot: %s finished earlier (%.0f s): kept", stage.name, record["seconds"])
            continue
        record.update(config=stage.config, done=False)
        record.setdefault("runs", [])
        stage.folder.mkdir(parents=True, exist_ok=True)
        stage.config_file.write_text(yaml.safe_dump(stage.config, sort_keys=False))
        log.info("pilot: %s: python -m %s --config %s (its log: %s)", stage.name, stage.module, stage.config_file,
                 stage.log_file)
        seconds = run_stage(stage, env, state)
        # A run a killed pilot left has no time (None): the work it lost is not counted.
        record.update(done=True, seconds=sum(r["seconds"] or 0 for r in record["runs"]), last_seconds=seconds,
                      ran_now=True)
        state.save()
    return state.data["stages"]


def run_stage(stage: Stage, env: dict, state: State) -> float:
    """The stage's job as a child process, its output both in the pilot's log and in the
    stage's log file; its seconds. A stop signal to the pilot is passed on to it."""
    started = time.monotonic()
    command = [sys.executable, "-m", stage.module, "--config", str(stage.config_file)]
    code = Path(__file__).resolve().parents[2]  # the copy of the project that runs (Ray's upload under a job)
    child_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")]))}
    with open(stage.log_file, "ab") as log_file:
        process = subprocess.Popen(command, cwd=code, env=child_env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        record = state.stage(stage.name)
        record["runs"].append({"started": time.time(), "seconds": None, "exit": None})
        state.data["running"] = {"stage": stage.name, "pid": process.pid, "start": start_time(process.pid)}
        state.save()
        last_error = ""
        try:
            for line in process.stdout:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                log_file.write(line)
                if line.startswith(b"error: "):
                    last_error = line.decode(errors="replace").strip().removeprefix("error: ")
            exit_code = process.wait()
        except BaseException:  # a stop signal (errors.Stopped) or an error here: the child stops too
            stop_child(process)
            raise
        finally:
            seconds = time.monotonic() - started
            record["runs"][-1].update(seconds=seconds, exit=process.poll())
            state.data.pop("running", None)
            state.save()
    if exit_code:
        raise StageFailed(f"pilot: stage {stage.name} (python -m {stage.module} --config {stage.config_file}) exited "
                          f"{exit_code}: {last_error or 'see its log'}; its log: {stage.log_file}. Fix it and run "
                          "the same command: finished stages are kept", exit_code if exit_code > 0 else 1)
    return seconds


def die_with_parent() -> None:
    """In the child, before it runs: SIGTERM when the pilot dies, however it dies (a SIGKILL
    included), so that no stage outlives its pilot; the job stops as on `ray job stop`."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_child(process: subprocess.Popen, wait_s: float = 30) -> None:
    """SIGTERM to the stage's job, then its own unwinding (it leaves Ray and exits 143)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            process.kill()


def start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot, /proc/<pid>/stat): with the pid, which
    process this is, though pids are reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def wait_for_leftover(state: State) -> None:
    """A stage's job that a killed pilot left: it got SIGTERM when the pilot died and is
    stopping; wait for it (it holds its OUT's lock), then SIGKILL it if it has not stopped."""
    running = state.data.pop("running", None)
    if not running or running.get("start") is None or start_time(running["pid"]) != running["start"]:
        return
    log.info("pilot: waiting for %s's job (pid %d), which the last pilot left stopping", running["stage"],
             running["pid"])
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while time.monotonic() < deadline and start_time(running["pid"]) == running["start"]:
        time.sleep(0.5)
    if start_time(running["pid"]) == running["start"]:
        os.kill(running["pid"], signal.SIGKILL)
        log.warning("pilot: %s's job (pid %d) did not stop within %d s: killed", running["stage"], running["pid"],
                    LEFTOVER_WAIT_S)
    state.save()


def run(cfg: Config, env: dict, started: float) -> dict:
    """The whole pilot once Ray is up (`env` names it for the stages' jobs): the stages not
    finished yet, then the report (pilot_report.py), written to pilot.path; the report.
    `started`: when the command started (time.monotonic), for its own overhead: its wall time
    beyond the jobs it ran."""
    from eagle_data.evaluation import pilot_report

    records = run_pilot(cfg, env)
    root = Path(cfg.pilot.path)
    recipes = list(cfg.pilot.recipes)
    folders = {name: {"out": str(root / "recipes" / name / "out"), "draft": str(root / "recipes" / name / "draft")}
               for name in recipes}
    figures = pilot_report.report(recipes, cfg.pilot.compare_to or recipes[:1], records, folders,
                                  root / "acceptance", cfg.acceptance.bootstrap, cfg.acceptance.seed)
    ran = sum(r["last_seconds"] for r in records.values() if r.get("last_seconds") and r.get("ran_now"))
    figures["this_run"] = {"seconds": time.monotonic() - started, "stages_seconds": ran}
    pilot_report.write(figures, root)
    return figures
