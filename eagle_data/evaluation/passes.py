"""The acceptance job's passes, each kept in acceptance.path/passes/ as it finishes, so that a
killed run loses only the pass under way: the same command again reuses every finished pass
and measures the rest, and the report is written from all of them at the end.

A pass is the target alone, or the target with one draft, over every prompt at every
temperature. Its file (`passes/target.json`, `passes/draft-<name>-<hash>.json`, written
whole or not at all) holds its rows and the settings that decide them (`settings`): the
prompts, the target and the draft (their paths and their files' sizes and modification
times), the temperatures, k, max_tokens, the seed, the stop tokens, the engine's settings.
A pass whose settings are this run's is reused (the log says so); one whose settings changed
is measured again, the log naming the settings that changed. Feeding settings (batch sizes,
replicas) decide no row and are not among them.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re

from eagle_data.config import Config
from eagle_data.draft_files import CONFIG, WEIGHTS
from eagle_data.evaluation.report_folder import PASSES, write_atomically
from eagle_data.model_files import resolve_model_path

log = logging.getLogger("eagle_data")

ROW_KEYS = ("sample_id", "source", "temperature", "generated_tokens", "engine_started", "engine_finished",
            "spec_accepted", "spec_drafted")


def pass_name(draft: str | None) -> str:
    """The pass's file name (without .json): `target`, or the draft's name made safe for a
    file name, with a hash of it so that two names never share a file."""
    if draft is None:
        return "target"
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", draft)[:64]
    return f"draft-{safe}-{hashlib.sha256(draft.encode()).hexdigest()[:8]}"


def files_stamp(folder: str, names: tuple[str, ...] | None = None) -> dict[str, list[int]] | None:
    """{file: [size, modification time in ns]} of a local folder's files (or of `names` in
    it): a file written again is another file. None for what is not a local folder (a hub id)."""
    if not os.path.isdir(folder):
        return None
    stamp = {}
    for name in sorted(names or os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            info = os.stat(path)
            stamp[name] = [info.st_size, info.st_mtime_ns]
    return stamp


def prompts_digest(sample_ids: list[str], prompts: list[list[int]]) -> str:
    digest = hashlib.sha256()
    for sample_id, tokens in zip(sample_ids, prompts):
        digest.update(json.dumps([sample_id, [int(t) for t in tokens]]).encode())
    return digest.hexdigest()[:16]


def settings(cfg: Config, prompts: str, stop_token_ids: list[int], draft: str | None) -> dict:
    """What decides a pass's rows (module docstring), as JSON values."""
    model = os.path.expanduser(resolve_model_path(cfg.model.path))
    decided = {
        "prompts": prompts,
        "model.path": cfg.model.path, "model files": files_stamp(model),
        "acceptance.temperatures": cfg.acceptance.temperatures, "top_p": 1.0, "acceptance.seed": cfg.acceptance.seed,
        "sampling.max_tokens": cfg.sampling.max_tokens, "stop_token_ids": sorted(stop_token_ids),
        "engine.device": cfg.engine.device, "engine.max_model_len": cfg.engine.max_model_len,
        "engine.tensor_parallel_size": cfg.engine.tensor_parallel_size, "engine.engine_kwargs": cfg.engine.engine_kwargs,
    }
    if draft is not None:
        decided.update({"draft": os.path.realpath(draft), "draft files": files_stamp(draft, (CONFIG, WEIGHTS)),
                        "acceptance.num_speculative_tokens": cfg.acceptance.num_speculative_tokens})
    return json.loads(json.dumps(decided))


def path(folder: str, name: str) -> str:
    return os.path.join(folder, PASSES, f"{name}.json")


def kept(folder: str, name: str, decided: dict, label: str) -> list[dict] | None:
    """The rows of the kept pass `name` when it was measured under `decided`; None (said in
    the log when a pass was there) when it must be measured."""
    file = path(folder, name)
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            found = json.load(f)
        recorded, rows = found["settings"], found["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:  # written whole by the job: damaged since
        log.warning("acceptance: %s: %s cannot be read (%s): measuring it again", label, file, e)
        return None
    changed = sorted(k for k in set(recorded) | set(decided) if recorded.get(k) != decided.get(k))
    if changed:
        log.info("acceptance: %s: measuring it again, its settings changed since %s (%s)", label, file,
                 ", ".join(changed))
        return None
    log.info("acceptance: %s: reusing the pass finished at %s (%s)", label, found.get("finished_at"), file)
    return rows


def keep(folder: str, name: str, decided: dict, rows: list[dict], seconds: float) -> None:
    """A finished pass, written whole into passes/ before the next pass starts."""
    record = {"settings": decided, "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "seconds": round(seconds, 1), "rows": [plain(r) for r in rows]}
    write_atomically(path(folder, name), json.dumps(record, allow_nan=False) + "\n")


def plain(row: dict) -> dict:
    """A row of the engine (numpy arrays, numpy numbers) as JSON values."""
    def value(v):
        if hasattr(v, "tolist"):
            return v.tolist()
        if isinstance(v, (list, tuple)):
            return [value(x) for x in v]
        return v
    return {k: value(row[k]) for k in ROW_KEYS}
