"""Where rows came from: every Parquet shard's footer names its OUT, run and config
fingerprint (contract.PROVENANCE), checked against manifest.json. At start a job quarantines
shards of another OUT or config (storage/damage.py) and rebuilds a lost or damaged
manifest.json from the footers; vocab/ and the report record the data they were computed from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import defaultdict

from eagle_data.errors import OutputMismatch
from eagle_data.storage import manifest as mf
from eagle_data.storage.contract import (CONFIG_KEY, FINGERPRINT_KEY, FOLDERS, HIDDEN_STATES, OUT_ID_KEY,
                                         PHASE_CONFIG, PHASE_OF_FOLDER, PROVENANCE, QUARANTINE)
from eagle_data.storage.folder import Output
from eagle_data.storage.hidden_states import read_header, shard_paths
from eagle_data.storage.shards import read_provenance, shard_files

log = logging.getLogger("eagle_data")


def foreign_reason(manifest: mf.Manifest, folder: str, found: dict[str, str]) -> str | None:
    """Why a shard of `folder` with footer `found` is not this OUT's under its current
    config, or None. Its rows would otherwise be counted as done, and labelled with this
    OUT's config."""
    if not found.get(OUT_ID_KEY):
        return "its footer names no OUT: written by an older eagle-data, or not by a job"
    if found[OUT_ID_KEY] != manifest.out_id:
        return f"written for another OUT (out_id {found[OUT_ID_KEY]}; this OUT's is {manifest.out_id})"
    phase = PHASE_OF_FOLDER[folder]
    config = manifest.phase_config(phase)
    expected = mf.fingerprint(config) if config is not None else None
    if found.get(FINGERPRINT_KEY) != expected:
        return (f"made under another {phase} config (fingerprint {found.get(FINGERPRINT_KEY)}; "
                f"this OUT's is {expected})")
    return None


def footer(fs, folder: str, path: str) -> dict[str, str]:
    """A shard's PROVENANCE keys: a Parquet shard's footer, a hidden-states shard's header."""
    if folder == HIDDEN_STATES:
        metadata, _ = read_header(fs, path)
        return {k: v for k, v in metadata.items() if k in PROVENANCE}
    return read_provenance(fs, path)


def shard_problem(out: Output, folder: str, path: str) -> str | None:
    return foreign_reason(out.manifest, folder, footer(out.fs, folder, path))


def all_shards(out: Output) -> list[tuple[str, str]]:
    """(folder, path) of every shard in OUT's folders, Parquet and hidden-states."""
    return ([(folder, path) for folder in FOLDERS for path in shard_files(out.fs, out.folder(folder))]
            + [(HIDDEN_STATES, path) for path in shard_paths(out.fs, out.folder(HIDDEN_STATES))])


def rebuild_manifest(out: Output) -> bool:
    """manifest.json lost or damaged while OUT holds shards: take OUT's out_id and each
    phase's config from the shards' footers (in memory; `keep_rebuilt` writes it under the
    lock), so that the usual config checks compare the current config with the one the rows
    were made under, and refuse a change naming its keys. The prompts phase is made again
    (deterministic: the ids in data/ stay valid) and its counts with it. Refused when the
    footers name no OUT, or several OUTs or configs: which rows belong here cannot be told."""
    if out.manifest.exists or not out.has_shards():
        return False
    footers = {(folder, path): footer(out.fs, folder, path) for folder, path in all_shards(out)}
    unnamed = [path for (_, path), found in footers.items() if not found.get(OUT_ID_KEY)]
    if unnamed:
        refuse(out, f"shards whose footer names no OUT (written by an older eagle-data): {shown(unnamed)}")
    by_out = group(footers, lambda folder, found: found[OUT_ID_KEY])
    if len(by_out) > 1:
        refuse(out, "shards of several OUTs: " + "; ".join(f"out_id {k}: {shown(v)}" for k, v in by_out.items()))
    phases: dict[str, dict] = {}
    for phase in PHASE_CONFIG:
        configs = group({key: found for key, found in footers.items() if PHASE_OF_FOLDER[key[0]] == phase},
                        lambda folder, found: found[CONFIG_KEY])
        if len(configs) > 1:
            refuse(out, f"{phase} shards made under several configs: " + "; ".join(
                f"fingerprint {mf.fingerprint(json.loads(k))}: {shown(v)}" for k, v in configs.items()))
        if configs:
            phases[phase] = {PHASE_CONFIG[phase]: json.loads(next(iter(configs)))}
    phases.setdefault("prompts", {})["status"] = "damaged"  # made again, with its counts
    [out_id] = by_out
    out.manifest.data.update(out_id=out_id, phases=phases, rebuilt_at=mf.now())
    log.warning("%s %s: rebuilding it from the footers of %d shards (out_id %s, phases %s)", out.manifest.path,
                f"is damaged ({out.manifest.damaged})" if out.manifest.damaged else "is missing",
                len(footers), out_id, ", ".join(sorted(phases)))
    return True


def keep_rebuilt(out: Output) -> None:
    """Write the rebuilt manifest; the damaged one is moved to quarantine/, not deleted."""
    if out.manifest.damaged:
        dest = f"{out.folder(QUARANTINE)}/manifest-{mf.new_run_id()}.json"
        out.fs.create_dir(out.folder(QUARANTINE), recursive=True)
        out.fs.move(out.manifest.path, dest)
        log.warning("moved the damaged %s to %s", out.manifest.path, dest)
        out.manifest.damaged = None
    out.manifest.save()


def group(footers: dict, key) -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for (folder, path), meta in footers.items():
        found[key(folder, meta)].append(path)
    return dict(found)


def shown(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def refuse(out: Output, why: str) -> None:
    raise OutputMismatch(
        f"{out.root} has no usable manifest.json ({out.manifest.damaged or 'missing'}) and cannot rebuild it "
        f"from its shards: {why}. Move the shards that do not belong here out of OUT, or rerun with --fresh "
        "to delete this OUT and start over, or use a new output.path")


def data_identity(out: Output) -> dict:
    """What data/ holds now: OUT, the generate config's fingerprint and its shards (names
    carry their run). vocab/ and the report record it; the report shows vocab coverage
    only when vocab/ was made from the same."""
    names = sorted(os.path.basename(p) for p in shard_files(out.fs, out.folder("data")))
    config = out.manifest.phase_config("generate")
    return {"out_id": out.manifest.out_id,
            "generate_fingerprint": mf.fingerprint(config) if config is not None else None,
            "data_shards": len(names),
            "data_digest": hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]}
