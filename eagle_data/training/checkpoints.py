"""The draft trainer's checkpoints (draft_loop.py's worker writes and restores them):
`step-<N>/` in trainer.save_path, speculators' draft (config.json, model.safetensors:
save_pretrained) and TRAINER_STATE (the optimizers', the schedules', the step and, on the
stream, the places of each epoch's order every worker had trained on by step N), each
reported to Ray Train as the run's latest checkpoint (a pointer to the folder: the draft is
written once), and restored from Ray Train's latest by a new group of workers: one Ray Train
starts after a lost worker (train.max_failures), or one a driver started again starts (the
same RunConfig name and storage: Ray Train's own restore).

A checkpoint is checked before it is loaded (`damage`: its files whole, from their sizes and
headers); a damaged one is skipped, and the newest intact one before it restored.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import uuid
import zipfile

from eagle_data.draft_files import check_draft_folder
from eagle_data.errors import EagleDataError
from eagle_data.training.stream_gate import consumed_places

log = logging.getLogger("eagle_data")

# What a checkpoint holds besides speculators' draft (config.json, model.safetensors).
TRAINER_STATE = "trainer_state.pt"
# The draft's weights a checkpoint leaves out: the verifier's, which build_draft loads again.
NOT_SAVED = ("verifier_",)
# A checkpoint's folder, and one being written aside (save): what a kill during a save leaves.
STEP = re.compile(r"step-(\d+)")
ASIDE = re.compile(r"\.(step-\d+|final)\.[0-9a-f]{32}\.tmp")


def save(draft, save_path: str, name: str, state: dict | None = None) -> str:
    """A speculators checkpoint folder (config.json, model.safetensors; with `state`, also
    TRAINER_STATE), written aside and renamed into place: a kill leaves a hidden .tmp folder,
    never half a checkpoint. A folder of that name from a lost attempt (written after the
    checkpoint its successor restored) is replaced."""
    import torch

    final = os.path.join(save_path, name)
    tmp = os.path.join(save_path, f".{name}.{uuid.uuid4().hex}.tmp")
    draft.save_pretrained(tmp)
    if state is not None:
        torch.save(state, os.path.join(tmp, TRAINER_STATE))
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    log.info("train: the draft saved to %s", final)
    return final


def checkpoint(draft, optimizers, schedulers, config: dict, step: int, consumed, trained: list, rank: int,
               world: int):
    """step-<N>/ with the trainer's state (rank 0), reported to Ray Train by every worker as
    the run's latest checkpoint (a pointer to the folder: the draft is written once). On the
    stream, the places every worker trained on since the last checkpoint are gathered into
    `consumed` ([epochs, per_epoch] bools), which is returned."""
    import ray.train
    import torch.distributed as dist

    if config["source"] == "stream":
        gathered = [None] * world
        if world > 1:
            dist.all_gather_object(gathered, trained)
        else:
            gathered = [trained]
        done = consumed_places([place for places in gathered for place in places], config["epochs"],
                               config["per_epoch"])
        consumed = done if consumed is None else consumed | done
    with tempfile.TemporaryDirectory() as pointer:
        if rank == 0:
            folder = save(draft, config["save_path"], f"step-{step}", {
                "step": step, "optimizers": [opt.state_dict() for opt in optimizers],
                "schedulers": [s.state_dict() for s in schedulers], "consumed": consumed})
            with open(os.path.join(pointer, "checkpoint.json"), "w") as f:
                json.dump({"path": folder, "step": step}, f)
        ray.train.report({"step": step},
                         checkpoint=ray.train.Checkpoint.from_directory(pointer) if rank == 0 else None)
    return consumed


def restore(latest, draft, optimizers, schedulers, config: dict, rank: int, world: int) -> dict | None:
    """The state of Ray Train's latest checkpoint (this run's, from a worker group that was
    lost or a driver started again), or of the newest intact one before it, loaded into the
    draft, the optimizers and the schedules; None on a first start. Rank 0 chooses the
    checkpoint for every rank (a rank that saw another would train other steps) and cuts
    metrics.jsonl back to its step."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    folder = None
    if latest is not None and rank == 0:
        with latest.as_directory() as pointer:
            with open(os.path.join(pointer, "checkpoint.json")) as f:
                folder = intact(json.load(f)["path"], config["save_path"])
    if world > 1:
        chosen = [folder]
        dist.broadcast_object_list(chosen, src=0)
        folder = chosen[0]
    if folder is None:
        metrics = os.path.join(config["save_path"], "metrics.jsonl")
        if rank == 0 and os.path.exists(metrics) and os.path.getsize(metrics):
            # A group started again before any checkpoint of this run was reported (a new run's
            # save_path starts empty), or whose every checkpoint is damaged: from step 0, without
            # the lost group's steps.
            log.info("train: a new group of workers starts from step 0 (%s)",
                     "no checkpoint reported yet" if latest is None else "no intact checkpoint")
            cut_metrics(config["save_path"], 0)
        return None
    try:
        state = torch.load(os.path.join(folder, TRAINER_STATE), weights_only=False)
        weights = load_file(os.path.join(folder, "model.safetensors"))
    except OSError as e:
        raise EagleDataError(f"train: the checkpoint to resume from, {folder}, cannot be read ({e}): "
                             "trainer.save_path must be storage every trainer node reads") from None
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    if unexpected or any(not k.startswith(NOT_SAVED) for k in missing):
        raise EagleDataError(f"train: {folder} is not this draft's checkpoint (missing {missing}, unexpected "
                             f"{unexpected})")
    for opt, saved in zip(optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(saved)
    for schedule, saved in zip(schedulers, state["schedulers"], strict=True):
        schedule.load_state_dict(saved)
    if rank == 0:
        cut_metrics(config["save_path"], state["step"])
        consumed = state["consumed"]
        log.info("train: a new group of workers resumes from %s: step %d of %d%s", folder, state["step"],
                 config["total_steps"], "" if consumed is None else
                 f", {int(consumed.sum())} places of the stream's epochs trained on")
    return state


def cut_metrics(save_path: str, step: int) -> None:
    """metrics.jsonl without the records of steps after `step` (the lost workers' steps
    after the checkpoint, made again) and without a line a kill cut short, written aside and
    renamed into place."""
    path = os.path.join(save_path, "metrics.jsonl")
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # cut short by a kill while it was written
                continue
            if record.get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def intact(folder: str, save_path: str) -> str | None:
    """`folder` (Ray Train's latest checkpoint) or, where it is damaged, the newest intact
    step-<N>/ before it; None where none is. Says which it skipped and why."""
    step = STEP.fullmatch(os.path.basename(folder))
    older = [n for n in reversed(saved_steps(save_path)) if step is None or n < int(step.group(1))]
    for candidate in [folder, *(os.path.join(save_path, f"step-{n}") for n in older)]:
        problem = damage(candidate)
        if problem is None:
            return candidate
        log.warning("train: the checkpoint %s is damaged (%s): skipped", candidate, problem)
    return None


def damage(folder: str) -> str | None:
    """What is wrong with a checkpoint folder, from its files' sizes and headers, before any
    is loaded: None where speculators' draft and TRAINER_STATE are whole."""
    if not os.path.isdir(folder):
        return "it is missing"
    try:
        check_draft_folder(folder, "the checkpoint")  # the acceptance job's check of a draft (draft_files.py)
    except EagleDataError as e:
        return str(e).removeprefix("the checkpoint: ")
    return state_problem(os.path.join(folder, TRAINER_STATE))


def state_problem(path: str) -> str | None:
    """TRAINER_STATE a whole archive (torch.save's zip): its directory, at the end, is there
    and every member lies before it. Its bytes are not read: torch.load reads them next."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.header_offset + 30 + len(info.filename.encode()) + info.compress_size > archive.start_dir:
                    return f"{TRAINER_STATE} is cut short ({info.filename} runs past its end)"
    except FileNotFoundError:
        return f"{TRAINER_STATE} is missing"
    except (zipfile.BadZipFile, OSError) as e:
        return f"{TRAINER_STATE} is not a whole archive ({type(e).__name__}: {e})"
    return None


def saved_steps(save_path: str) -> list[int]:
    """The steps of save_path's step-<N>/ checkpoints, in order."""
    return sorted(int(m.group(1)) for name in os.listdir(save_path) if (m := STEP.fullmatch(name)))


def cut_short(save_path: str) -> list[str]:
    """The checkpoints whose save a kill cut short: folders save() writes aside, left there."""
    return sorted(name for name in os.listdir(save_path) if ASIDE.fullmatch(name)
                  and os.path.isdir(os.path.join(save_path, name)))
