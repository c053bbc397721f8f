"""Running the job: the setup checks, then the phases on OUT = cfg.output.path.

Everything that can be wrong with the setup (paths, dataset files, OUT, config vs OUT) is
checked before Ray starts; rerunning the same command resumes.
"""

from __future__ import annotations

import logging
import os
import time

import pyarrow as pa
import pyarrow.fs as pafs
import ray

from eagle_data.config import Config
from eagle_data.errors import EmptyResult, MissingInput, NotWritable, ignore_stop_signals, stop_on_signals
from eagle_data.job.stages.engines import ENGINE_CLASSES, check_engine_kwargs
from eagle_data.job.stages.engines.exit_noise import quiet_worker_logs
from eagle_data.job.fingerprints import generate_config, hidden_states_config, prompt_config
from eagle_data.job.phases.generate import run_generate
from eagle_data.job.phases.hidden_states import run_hidden_states
from eagle_data.job.phases.prompts import run_prompts
from eagle_data.job.ray_internals import ray_data_progress, wait_for_actors_to_exit
from eagle_data.job.stages.source import locate
from eagle_data.model_files import check_tokenizer_path, hub_reachable, is_hub_id, load_tokenizer, use_hub_cache_only
from eagle_data.storage.damage import check_prompts_record, quarantine_corrupt
from eagle_data.storage.folder import Output
from eagle_data.storage.lock import lock
from eagle_data.storage.provenance import keep_rebuilt, rebuild_manifest
from eagle_data.storage.report import write_report

log = logging.getLogger("eagle_data")


PHASES = ("prompts", "generate", "hidden_states", "all")


def run(cfg: Config, phase: str = "all", fresh: bool = False, engine=None, allow_empty: bool = False) -> dict:
    """Run `phase` (PHASES; `all` = prompts, generate, and hidden_states when
    hidden_states.enabled). `engine(ds, cfg, pad_id) -> ds` replaces the configured engine
    stage of the generate phase (benchmarks put a simulated one there). A prompts phase
    that left 0 prompts (an empty dataset, or every row skipped) raises EmptyResult after
    its report, unless `allow_empty`."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {PHASES}")
    check_engine_kwargs(cfg)
    hidden = phase == "hidden_states" or (phase == "all" and cfg.hidden_states.enabled)
    out = open_output(cfg.output.path, fresh)
    out.check_ours()  # before anything is written, moved or deleted there
    # Exists, supported files only, and apart from OUT (neither inside the other): checked
    # before check_writable creates OUT, which must not appear inside a dataset folder.
    local_out = out.root if isinstance(out.fs, pafs.LocalFileSystem) else None
    layout = locate(cfg.source, local_out) if phase in ("prompts", "all") else None
    out.check_writable()
    rebuilt = False
    if not fresh:
        # A lost or damaged manifest.json: the shards' footers say which configs made them.
        rebuilt = rebuild_manifest(out)
        if phase != "hidden_states":
            out.manifest.check_prompts_config(prompt_config(cfg))
        if phase in ("generate", "all"):
            out.manifest.check_generate_config(generate_config(cfg))
        if hidden:
            out.manifest.check_hidden_states_config(hidden_states_config(cfg))
    check_hub(cfg, uses_hub_dataset=layout is not None and layout.kind == "hub")
    check_model_files(cfg, need_weights=phase != "prompts")
    with lock(out):
        if fresh:
            log.warning("--fresh: deleting what earlier runs wrote in %s", out.root)
            out.wipe()
        elif rebuilt or out.manifest.damaged:
            keep_rebuilt(out)
        out.clear_staging()
        quarantine_corrupt(out)
        check_prompts_record(out)
        started = time.monotonic()
        if not ray.is_initialized():
            ray.init()  # joins the cluster when there is one, else starts a local instance
            stop_on_signals()  # instead of the SIGTERM handlers ray.init installed (errors.stop_on_signals)
        quiet_worker_logs()
        ray_data_progress(cfg.output.ray_data_progress)
        result = {"seconds": {"ray start": time.monotonic() - started}}
        if phase in ("prompts", "all"):
            started = time.monotonic()
            result["prompts"] = run_prompts(cfg, out)
            report(out)
            result["seconds"]["prompts"] = time.monotonic() - started
        # 0 prompts is a wrong result, not a success: refused after the prompts phase (its
        # skipped/ and report written) and before a generate phase, unless allowed.
        if not allow_empty and out.manifest.prompts_complete() and (out.manifest.prompts_counts or {}).get("prompts") == 0:
            raise EmptyResult(empty_message(cfg, out, out.manifest.prompts_counts))
        if phase in ("generate", "all"):
            started = time.monotonic()
            result["generate"] = run_generate(cfg, out, engine)
            report(out)
            result["seconds"]["generate"] = time.monotonic() - started
            loads = out.manifest.generate_runs[-1].get("engine_load_s")
            if loads:  # the first replica's model load, within generate
                result["seconds"]["of which loading the model"] = loads[0]
        if hidden:
            started = time.monotonic()
            result["hidden_states"] = run_hidden_states(cfg, out)
            report(out)
            result["seconds"]["hidden states"] = time.monotonic() - started
    return result


def close_ray() -> None:
    """Let the engine replicas shut down and their last output reach the log, then leave
    Ray: what the job prints after this (its summary) is the last thing in its log."""
    if ray.is_initialized():
        wait_for_actors_to_exit(ENGINE_CLASSES)
        ignore_stop_signals()  # the job is done: a Ctrl-C now would only cut the shutdown short
        ray.shutdown()


def leave_ray() -> None:
    """After a stop signal: leave Ray at once, without waiting for the replicas (`ray job
    stop` SIGKILLs 3 s after its SIGTERM). ray.shutdown stops every process of the local
    instance this job started, and only disconnects from a cluster it joined; with further
    stop signals ignored, a second Ctrl-C cannot cut it short and leave Ray's agents running.
    Called even when Ray looks shut down: a shutdown cut short has disconnected but may not
    have stopped the local processes yet, and ray.shutdown stops what is left."""
    ignore_stop_signals()
    ray.shutdown()


def report(out: Output) -> None:
    """The report after a phase; the data is complete whether or not it can be written, so
    no error here fails the job (a full disk, a file in the way, a bug in a plot): the job's
    exit code is the data's. The one place that catches a report error broadly."""
    try:
        write_report(out)
    except Exception as e:
        log.warning("the phase's data is complete, but its report could not be written (%s: %s); "
                    "fix that and run `python -m eagle_data report %s`", type(e).__name__, e, out.root)


def check_hub(cfg: Config, uses_hub_dataset: bool) -> None:
    """With a hub id (dataset or model) and no hub, read the local HF cache only: a cached id
    works, a missing one fails at once instead of after a minute of retries."""
    hub_ids = [p for p in (cfg.model.path, cfg.model.tokenizer_path) if is_hub_id(p)]
    if (uses_hub_dataset or hub_ids) and not os.environ.get("HF_HUB_OFFLINE") and not hub_reachable():
        log.warning("the model/dataset hub is unreachable: using the local HF cache only for %s",
                    ", ".join([*(["source.dataset " + cfg.source.dataset] if uses_hub_dataset else []), *hub_ids]))
        use_hub_cache_only()


def open_output(path: str, fresh: bool = False) -> Output:
    try:
        return Output(path, fresh=fresh)
    # An unreachable filesystem, or a URI neither pyarrow nor fsspec knows (ValueError) or
    # whose fsspec package is not installed (ImportError).
    except (OSError, ValueError, ImportError, pa.ArrowException) as e:
        raise NotWritable(f"output.path {path!r} cannot be opened ({e}); check the URI and "
                          "credentials, or choose a local folder") from None


def check_model_files(cfg: Config, need_weights: bool) -> None:
    check_tokenizer_path(cfg.model.tokenizer_path)
    if need_weights:
        check_tokenizer_path(cfg.model.path)
    try:
        load_tokenizer(cfg.model.tokenizer_path, cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise MissingInput(
            f"cannot load the tokenizer from model.tokenizer/model.path {cfg.model.tokenizer_path!r}: {e}. "
            "A local path must hold a tokenizer; a hub id needs the hub or a filled HF cache."
        ) from None


def empty_message(cfg: Config, out: Output, counts: dict) -> str:
    if not counts.get("selected"):
        why = f"source.dataset {cfg.source.dataset!r} holds no rows"
    else:
        reasons = ", ".join(f"{k} {v}" for k, v in counts.get("skipped_by_reason", {}).items())
        why = (f"all {counts['selected']} selected rows of {cfg.source.dataset!r} were skipped ({reasons}); "
               f"see {out.root}/skipped/ (reason, detail)")
    return f"0 prompts: {why}. Nothing to generate; pass --allow-empty to accept an empty result"
