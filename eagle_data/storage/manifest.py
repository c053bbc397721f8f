"""OUT/manifest.json: what made this OUT, and what each phase and run produced.

Its shape is described in storage/contract.py. A phase records each run the same way
(`start_run` ... `finish_run`): the run's whole config and the library versions go into
the run's record, so a reader always sees the settings of the latest run (a rerun with
`--set output.max_attempts=5` is read back as 5). Readers use the typed accessors below.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import platform
import time
import uuid

import eagle_data
from eagle_data.errors import EagleDataError, OutputMismatch
from eagle_data.storage.contract import (CONFIG_KEY, FINGERPRINT_KEY, MANIFEST, MANIFEST_VERSION, OUT_ID_KEY,
                                         PHASE_CONFIG, PHASE_OF_FOLDER, PHASES, RUN_KEY)
from eagle_data.storage.files import read_json, write_json

FOLDERS_OF_PHASE = {phase.name: phase.folders for phase in PHASES}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def library_versions() -> dict:
    versions = {"python": platform.python_version(), "eagle-data": eagle_data.__version__}
    for name in ("ray", "transformers", "pyarrow", "torch", "vllm"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def fingerprint(config: dict) -> str:
    """A phase config's short hash: what a shard's footer names (FINGERPRINT_KEY)."""
    return hashlib.sha256(config_text(config).encode()).hexdigest()[:16]


def config_text(config: dict) -> str:
    return json.dumps(normalised(config), sort_keys=True)


def shard_metadata(out_id: str, run_id: str, config: dict) -> dict[str, str]:
    """The footer of a shard made by `run_id` under its phase's `config` (contract.PROVENANCE)."""
    return {OUT_ID_KEY: out_id, RUN_KEY: run_id, FINGERPRINT_KEY: fingerprint(config), CONFIG_KEY: config_text(config)}


class Manifest:
    def __init__(self, fs, out: str, check_version: bool = True):
        """`check_version` False: --fresh, which deletes an OUT of another version too."""
        self.fs, self.out = fs, out
        self.path = f"{out}/{MANIFEST}"
        self._started: set[str] = set()  # the run ids this process started (stop_runs)
        found, self.damaged = read_manifest(fs, self.path)
        # A manifest.json of ours has `phases`; another one (a user's) is not ours.
        self.foreign = found is not None and "phases" not in found
        self.exists = found is not None and not self.foreign
        found = None if self.foreign else found
        # A new OUT's identity: every shard written into it names it (contract.OUT_ID_KEY).
        self.data = found or {"schema_version": MANIFEST_VERSION, "out_id": uuid.uuid4().hex}
        self.data.setdefault("phases", {})
        version = self.data.get("schema_version", 1)
        if version != MANIFEST_VERSION and check_version:
            raise EagleDataError(f"{self.path} has schema_version {version}; this eagle-data reads "
                                 f"{MANIFEST_VERSION}: " + ("upgrade eagle-data to read this OUT" if version > MANIFEST_VERSION
                                                            else "it was made by an older eagle-data, whose shards lack columns or "
                                                                 "footers this one relies on; make it again (--fresh) or use a new output.path"))

    @property
    def out_id(self) -> str | None:
        return self.data.get("out_id")

    def phase_config(self, phase: str) -> dict | None:
        """The config that decides `phase`'s rows (contract.PHASE_CONFIG), None before it ran."""
        return self.data["phases"].get(phase, {}).get(PHASE_CONFIG[phase])

    def shard_metadata(self, folder: str, run_id: str) -> dict[str, str]:
        """The footer of a shard `run_id` writes into `folder` (after its phase's start_run)."""
        return shard_metadata(self.out_id, run_id, self.phase_config(PHASE_OF_FOLDER[folder]) or {})

    def save(self) -> None:
        self.data["schema_version"] = MANIFEST_VERSION
        self.fs.create_dir(self.out, recursive=True)
        write_json(self.fs, self.path, self.data)
        self.exists = True

    # -- recording a run (the job) -------------------------------------------------------

    def _phase(self, name: str) -> dict:
        return self.data["phases"].setdefault(name, {})

    def start_run(self, phase: str, config: dict, phase_fields: dict | None = None, **run_fields) -> dict:
        """Append a running run to `phase` and save; `phase_fields` go into the phase's
        record, `run_fields` into the run's."""
        run = {"run_id": new_run_id(), "started_at": now(), "status": "running",
               "config": config, "versions": library_versions(), **run_fields}
        self._started.add(run["run_id"])
        record = self._phase(phase)
        record.update(phase_fields or {}, status="running", run_id=run["run_id"], started_at=run["started_at"])
        record.setdefault("runs", []).append(run)
        self.save()
        return run

    def stop_runs(self, signal_name: str) -> None:
        """A stop signal (SIGTERM, Ctrl-C) ended this process: every run it started and did
        not finish, and its phase, say `stopped` (a killed run stays `running`); saved."""
        stopped = [record for record in self.data["phases"].values()
                   if record.get("status") == "running" and record.get("runs")
                   and record["runs"][-1].get("run_id") in self._started]
        for record in stopped:
            record["runs"][-1].update(status="stopped", stopped_at=now(), stopped_by=signal_name)
            record["status"] = "stopped"
        if stopped:
            self.save()

    def finish_run(self, phase: str, run: dict, counts: dict, **fields) -> None:
        """Mark `run` and its phase complete, with the run's own figures (`fields`); `counts`
        are the phase's totals over every run so far."""
        run.update(status="complete", finished_at=now(), **fields)
        self._phase(phase).update(status="complete", counts=counts, finished_at=run["finished_at"])
        self.save()

    def mark(self, phase: str, status: str) -> None:
        """Set a phase's status (`damaged`: its rows must be made again); saved by the caller."""
        self._phase(phase)["status"] = status

    # -- reading --------------------------------------------------------------------------

    def phase(self, name: str) -> dict:
        """A copy of one phase's record ({} when it never ran)."""
        return json.loads(json.dumps(self.data["phases"].get(name, {})))

    def status(self, phase: str) -> str | None:
        """running | complete | stopped | damaged; None before it ran. A record without a status
        (written before phases had one) has its latest run's."""
        record = self.data["phases"].get(phase, {})
        runs = record.get("runs", [])
        return record.get("status", runs[-1].get("status") if runs else None)

    def finished(self, phase: str) -> bool:
        """The phase's latest run finished and nothing since made its rows doubtful (a
        killed run stays `running`, a stopped one says `stopped`)."""
        return self.status(phase) == "complete"

    def counts(self, phase: str) -> dict:
        """The phase's totals over every run so far ({} before a run finished)."""
        return dict(self.data["phases"].get(phase, {}).get("counts", {}))

    def runs(self, phase: str) -> list[dict]:
        return list(self.data["phases"].get(phase, {}).get("runs", []))

    @property
    def config(self) -> dict:
        """The resolved config of the latest run of any phase ({} before any run)."""
        runs = [r for p in self.data["phases"].values() for r in p.get("runs", []) if "config" in r]
        return max(runs, key=lambda r: r["started_at"])["config"] if runs else {}

    @property
    def max_attempts(self) -> int:
        return self.config.get("output", {}).get("max_attempts", 1)

    @property
    def turns(self) -> str:
        return self.config.get("prompt", {}).get("turns", "first_user")

    @property
    def trust_remote_code(self) -> bool:
        return self.config.get("model", {}).get("trust_remote_code", False)

    @property
    def tokenizer(self) -> dict:
        """The token ids the engine was fed with (path, vocab_size, eos_ids, pad_id,
        reasoning markers), as the phase that answered recorded them; {} before it ran."""
        records = self.data["phases"].values()
        return dict(next((r["tokenizer"] for r in records if "tokenizer" in r), {}))

    # -- checks before a run --------------------------------------------------------------

    def check_config(self, phase: str, config: dict) -> None:
        """Refuse to mix rows of `phase` made under another config (the keys that decide
        its rows, job/fingerprints.py): naming the changed keys."""
        made = self.data["phases"].get(phase, {}).get(PHASE_CONFIG[phase])
        config = normalised(config)
        if made is None or made == config:
            return
        # A key recorded on one side only (sampling.seed is in the prompt config only with
        # variants): its value then is the one in the latest run's whole config.
        runs = self.runs(phase)
        resolved = runs[-1].get("config", {}) if runs else {}
        changed = sorted(k for k in set(made) | set(config)
                         if made.get(k, setting(resolved, k)) != config.get(k, setting(resolved, k)))
        # A key recorded only while it is not its default (prompt.answers): the latest run's value
        # is the recorded one, so a key on one side only is what changed.
        changed = changed or sorted(set(made) ^ set(config))
        folders = ", ".join(f"{f}/" for f in FOLDERS_OF_PHASE[phase])
        raise OutputMismatch(
            f"{self.out} holds {phase} rows ({folders}) made with different settings (changed: {', '.join(changed)}); "
            "mixing them would make an inconsistent data set. Use another output.path, or rerun with "
            "--fresh to delete this OUT and start over."
        )


def setting(config: dict, key: str):
    """The value of a flattened `section.key` in a nested resolved config (None if absent)."""
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def read_manifest(fs, path: str) -> tuple[dict | None, str | None]:
    """(its JSON, None), (None, None) when there is none, or (None, why) for a manifest.json
    of ours that does not parse (cut short, zeroed): the job rebuilds it from the shards.
    Text that is not a JSON object from its first byte is another tool's file, not ours."""
    try:
        found = read_json(fs, path)
    except ValueError as e:
        with fs.open_input_stream(path) as f:
            start = f.read(64).lstrip()
        ours = start[:1] in (b"{", b"", b"\0")  # ours, cut short (or zeroed by a disk fault)
        return ({"unreadable": True}, None) if not ours else (None, f"{type(e).__name__}: {e}")
    return (found if isinstance(found, dict) else {"unreadable": True}), None


def normalised(config: dict) -> dict:
    """As it reads back from JSON, so a stored config compares equal to a fresh one."""
    return json.loads(json.dumps(config))
