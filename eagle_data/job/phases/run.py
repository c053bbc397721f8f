"""Running the job: the setup checks, then the phases on OUT = cfg.output.path.

Everything that can be wrong with the setup (paths, dataset files, OUT, config vs OUT) is
checked before Ray starts; rerunning the same command resumes.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pyarrow as pa
import pyarrow.fs as pafs

from eagle_data.config import Config
from eagle_data.errors import ConfigError, EmptyResult, MissingInput, NotWritable, OutputMismatch, stop_signal
from eagle_data.job.phases import PHASE_BY_NAME, PHASES
from eagle_data.job.ray_session import start_ray
from eagle_data.job.stages.engines import check_engine_kwargs
from eagle_data.job.stages.source import check_source_fields, content_stamp, locate, stamp_changes
from eagle_data.model_files import (check_tokenizer_path, check_weights, hub_reachable, is_hub_id, load_tokenizer,
                                   use_hub_cache_only)
from eagle_data.storage.damage import check_prompts_record, quarantine_corrupt
from eagle_data.storage.folder import Output
from eagle_data.storage.lock import lock
from eagle_data.storage.provenance import keep_rebuilt, rebuild_manifest
from eagle_data.storage.report import write_report

log = logging.getLogger("eagle_data")


PHASE_CHOICES = (*(phase.name for phase in PHASES), "all")


def run(cfg: Config, phase: str = "all", fresh: bool = False, engine=None, allow_empty: bool = False,
        keep_prompts: bool = False) -> dict:
    """Run `phase` (a name of PHASES, or `all`: every phase whose `in_all` says so).
    `engine` replaces the configured engine stage of the phases that take one (benchmarks
    put a simulated one there). A phase whose finished rows are none (the prompts phase
    left 0 prompts: an empty dataset, or every row skipped) raises EmptyResult after its
    report, unless `allow_empty`. A finished phase that read a dataset whose files changed
    since is refused (OutputMismatch), unless `keep_prompts`."""
    if phase not in PHASE_CHOICES:
        raise ValueError(f"phase {phase!r} is not one of {PHASE_CHOICES}")
    check_engine_kwargs(cfg)
    chosen = [p for p in PHASES if p.name == phase or (phase == "all" and p.in_all(cfg))]
    wipe = fresh and phase == "all"  # --fresh: all the project wrote; with --phase X: X and the phases after it
    reset = [p.name for p in PHASES[PHASES.index(chosen[0]):]] if fresh and not wipe else []
    for p in chosen:
        if set(p.reads) & set(reset):  # cannot happen while a phase reads only earlier ones
            raise ConfigError(f"--fresh --phase {phase} would delete what the {p.name} phase reads "
                              f"({', '.join(sorted(set(p.reads) & set(reset)))}); use --fresh without --phase")
    out = open_output(cfg.output.path, wipe)
    out.check_ours()  # before anything is written, moved or deleted there
    # Exists, supported files only, and apart from OUT (neither inside the other): checked
    # before check_writable creates OUT, which must not appear inside a dataset folder.
    local_out = out.root if isinstance(out.fs, pafs.LocalFileSystem) else None
    layout = locate(cfg.source, local_out) if any(p.reads_dataset for p in chosen) else None
    if layout is not None:
        check_source_fields(cfg.source, layout)  # a misspelled source.fields field, before Ray starts
    out.check_writable()
    rebuilt = False
    if not wipe:
        # A lost or damaged manifest.json: the shards' footers say which configs made them.
        rebuilt = rebuild_manifest(out)
        for name in dict.fromkeys(n for p in chosen for n in p.locked_by()):
            if name in reset:
                continue
            config = PHASE_BY_NAME[name].fingerprint(cfg)
            if not out.holds_rows(name) and out.manifest.phase_config(name) not in (None, config):
                # It published no rows (a filter that selected none): nothing a new config could
                # mix with, so it starts over under this one, with the phases after it.
                log.warning("the %s phase published no rows under its recorded config: starting it over", name)
                reset = reset or [p.name for p in PHASES[PHASES.index(PHASE_BY_NAME[name]):]]
                continue
            out.manifest.check_config(name, config)
        for p in chosen:
            if p.reads_dataset and p.name not in reset and out.manifest.finished(p.name):
                check_dataset(out, p.name, layout, keep_prompts)
    check_hub(cfg, uses_hub_dataset=layout is not None and layout.kind == "hub")
    check_model_files(cfg, need_weights=any(p.needs_model_weights for p in chosen))
    with lock(out):
        if wipe:
            log.warning("--fresh: deleting what earlier runs wrote in %s", out.root)
            out.wipe()
        else:
            if rebuilt or out.manifest.damaged:
                keep_rebuilt(out)
            if reset:
                log.warning("deleting the rows and records of the %s phase%s in %s", ", ".join(reset),
                            "s" if len(reset) > 1 else "", out.root)
                out.reset(reset[0])
        out.clear_staging()
        quarantine_corrupt(out)
        check_prompts_record(out)
        result = {"seconds": {"ray start": start_ray(cfg.output.ray_data_progress)}}
        try:
            for p in chosen:
                # 0 prompts is a wrong result, not a success: refused before a phase would work
                # from it, and after the phase that made it (its report written), unless allowed.
                refuse_empty(cfg, out, allow_empty, PHASES[:PHASES.index(p)])
                started = time.monotonic()
                result[p.name] = p.run(cfg, out, engine)
                report(out)
                result["seconds"][p.name] = time.monotonic() - started
                loads = (out.manifest.runs(p.name) or [{}])[-1].get("engine_load_s")
                if loads:  # the first replica's model load, within the phase
                    result["seconds"][f"of which {p.name} loading the model"] = loads[0]
        except KeyboardInterrupt as e:  # a stop signal (errors.Stopped) or Ctrl-C
            record_stop(out, e)
            raise
        refuse_empty(cfg, out, allow_empty, PHASES[:PHASES.index(chosen[-1]) + 1])
    return result


def record_stop(out: Output, stop: KeyboardInterrupt) -> None:
    """The manifest says that the run a stop signal ended was stopped, not that it still
    runs; a manifest that cannot be written then leaves it `running`, as a kill does."""
    try:
        out.manifest.stop_runs(signal.Signals(stop_signal(stop)).name)
    except Exception as e:  # the stop is what the job reports
        log.warning("the stopped run could not be recorded in %s/manifest.json (%s: %s)", out.root,
                    type(e).__name__, e)


def check_dataset(out: Output, phase: str, layout, keep: bool) -> None:
    """The finished `phase` read the dataset: refuse it while the dataset's files differ
    from the stamp it recorded (a row edited or added would otherwise never be read)."""
    recorded, now = out.manifest.phase(phase).get("dataset_stamp"), content_stamp(layout)
    if now is None:
        return  # a hub dataset
    if recorded is None:  # made before stamps were recorded, or a rebuilt manifest
        log.warning("the %s phase in %s recorded no stamp of its dataset's files: a changed dataset "
                    "is not noticed (--fresh --phase %s makes it again)", phase, out.root, phase)
        return
    changes = stamp_changes(recorded, now)
    if not changes:
        return
    said = "; ".join(changes)
    if keep:
        log.warning("source.dataset changed since the %s phase read it (%s): --keep-prompts goes on with "
                    "the %s made from it before", phase, said, phase)
        return
    raise OutputMismatch(
        f"source.dataset changed since the {phase} phase in {out.root} read it: {said}. Rerun with "
        f"--keep-prompts to go on with the {phase} made from it before, or with --fresh --phase {phase} "
        f"to make them again from the dataset as it is now (which deletes the later phases' rows too)")


def refuse_empty(cfg: Config, out: Output, allow_empty: bool, phases) -> None:
    """Refuse when one of `phases` finished with no rows: before a phase would work from
    them (the phases before it), and after the last one ran."""
    for phase in phases:
        why = phase.empty(cfg, out)
        if why and not allow_empty:
            raise EmptyResult(why)


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
        check_weights(cfg.model.path)
    try:
        load_tokenizer(cfg.model.tokenizer_path, cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise MissingInput(
            f"cannot load the tokenizer from model.tokenizer/model.path {cfg.model.tokenizer_path!r}: {e}. "
            "A local path must hold a tokenizer; a hub id needs the hub or a filled HF cache."
        ) from None
