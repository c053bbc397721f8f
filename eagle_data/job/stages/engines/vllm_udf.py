"""Ray's vLLM stage UDF (ray.data.llm, Ray 2.60, with the vLLM it pins, 0.29) with compact
log-probabilities, a shutdown that prints nothing when all went well, and on vLLM's CPU
build the engine's threads over the replica's cores (a share of its own for each rank)."""

from __future__ import annotations

import os
import time

from eagle_data.errors import ConfigError
from eagle_data.job.stages.engines.logprobs import flat_logprob_values
from eagle_data.job.stages.engines.processes import descendants, die_with_this_process, wait_for_exit, watchdogs
from eagle_data.job.stages.engines.state_files import prepare, take
from eagle_data.job.stages.engines.stats import EngineStats


def vllm_stage_udf(cpu_threads: int | None = None):
    """Ray's `vLLMEngineStageUDF`, but:

    - `generate_async` is Ray's (`vLLMEngineWrapper.generate_async`: the same request,
      semaphore and timing) except that it asks vLLM for its flat log-probabilities and
      hands them on as arrays (logprobs.py); Ray's per-token dicts make Ray Data pickle
      each row (docs/performance.md, "Settled"). A request that names a hidden-states file
      (the hidden-states pass) gets the file's states as columns, read back here on the
      engine's node and removed (state_files.py). A request marked for measuring (the
      acceptance job's: `extra_args.measure`) gets its wall-clock span and, under
      speculative decoding, vLLM's per-request counts as columns (`measurement`).
    - A request that fails with vLLM's `EngineGenerateError` (an unexpected error, with no
      message) is raised as what `engine_failure` makes of it: the engine's death, so that
      Ray restarts the replica and asks the row again, or the cause's text for failed/.
    - At shutdown it cancels the task reading the engine's outputs first (vLLM 0.29 stops
      the engine before it, and the task logs an `EngineDeadError`), and waits for vLLM's
      processes to exit: Ray kills an exiting actor's children, the resource tracker among
      them, which a vLLM worker then relaunches to print `KeyError` tracebacks.
    - Every process it starts (vLLM's EngineCore and workers, the resource tracker) ends with
      its actor however the actor ends (processes.die_with_this_process): a driver that
      started its own Ray and was SIGKILLed left them running, re-parented to pid 1.
    - On vLLM's CPU build its OpenMP threads run on `cpu_threads` (None: all) of the cores
      the replica's actor may use (bind_cpu_threads)."""
    import atexit
    import multiprocessing.resource_tracker

    from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF

    class VLLMEngine(vLLMEngineStageUDF):
        def __init__(self, *args, **kwargs):
            die_with_this_process()  # before anything is started
            multiprocessing.resource_tracker.ensure_running()
            engine = kwargs.get("engine_kwargs", {})
            bind_cpu_threads(engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1),
                             cpu_threads)
            super().__init__(*args, **kwargs)
            self.llm.generate_async = self.generate_async  # called by Ray's _generate_with_error_handling
            self.stats = EngineStats.attach(self.llm.engine)
            transfer = engine.get("kv_transfer_config") or {}
            self.states_dtype = engine.get("dtype")
            scratch = (transfer.get("kv_connector_extra_config") or {}).get("shared_storage_path")
            if scratch:
                prepare(scratch)
            self.shut = False
            # At the actor's exit vLLM's own exit hook (a weakref finalizer) may stop the
            # engine before `__del__` runs; atexit runs hooks last-registered first, so
            # this one comes before vLLM's.
            atexit.register(self.shut_down)

        async def generate_async(self, row: dict) -> tuple:
            import asyncio

            from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMOutputData
            from vllm.v1.engine.exceptions import EngineGenerateError

            wrapper = self.llm
            k = (row.get("sampling_params") or {}).get("logprobs") or 0
            states_path = states_file(row.get("sampling_params"))
            if k:
                row["sampling_params"] = {**row["sampling_params"], "flat_logprobs": True}
            measured = measure(row.get("sampling_params"))
            request = await wrapper._prepare_llm_request(row)
            started, wall = time.perf_counter(), time.time()
            async with wrapper.semaphore:
                try:
                    output = await wrapper._generate_async(request)
                except EngineGenerateError as e:
                    raise await engine_failure(wrapper.engine, e) from e
            took = time.perf_counter() - started
            extra = measurement(output.outputs[0], wall, time.time()) if measured else {}
            if k:
                extra = flat_logprob_values(output.outputs[0], k)
                output.outputs[0].logprobs = None  # Ray's per-token dicts are never built
            if states_path:  # off the event loop: it waits for the connector's write
                extra.update(await asyncio.to_thread(take, states_path, self.states_dtype))
            return request, {**vLLMOutputData.from_vllm_engine_output(output).model_dump(), **extra}, took

        def shut_down(self) -> None:
            if getattr(self, "shut", True):
                return
            self.shut = True
            engine_processes = (descendants(os.getpid()) - {multiprocessing.resource_tracker._resource_tracker._pid}
                                - watchdogs())
            stop_output_handler(self.llm.engine)
            self.llm.shutdown()
            wait_for_exit(engine_processes)

        def __del__(self):
            self.shut_down()

    return VLLMEngine


async def engine_failure(engine, error: Exception, wait_s: float = 10.0) -> Exception:
    """What a request's `EngineGenerateError` is raised as. vLLM raises it, with no message,
    for any unexpected error in a request, also for one that came from a rank dying under it
    (the engine's first request asks the ranks for their tasks); vLLM marks the engine dead
    a moment later. If the engine is dead or dies within `wait_s`: `EngineDeadError`, on which
    Ray's stage exits the replica's actor and Ray restarts it and retries the batch, so the
    row is asked again in this run instead of going to failed/. Otherwise the error again,
    with the cause's type and text, which the row's failed/ record keeps."""
    import asyncio

    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    cause = error.__cause__ or error
    reason = f"{type(cause).__name__}: {cause}"
    deadline = time.monotonic() + wait_s
    while True:
        if engine.errored:
            return EngineDeadError(f"a request failed as the engine died ({reason})")
        if time.monotonic() >= deadline:
            return EngineGenerateError(reason)
        await asyncio.sleep(0.1)


def measure(sampling_params: dict | None) -> bool:
    """Whether a request asks for its measurement (the acceptance job's requests)."""
    return bool(((sampling_params or {}).get("extra_args") or {}).get("measure"))


def measurement(output, started: float, finished: float) -> dict:
    """A measured request's columns: its wall-clock span in the engine (seconds since the
    epoch: spans of one replica overlap, and the replica's tokens over its whole span are its
    throughput) and, under speculative decoding, vLLM's count for each of the target's steps
    of the draft tokens it accepted and proposed (`per_request_spec_decode_metrics:
    detailed`); empty lists without a draft."""
    metrics = getattr(output, "spec_decode_metrics", None)
    return {"engine_started": started, "engine_finished": finished,
            "spec_accepted": list(metrics.per_step_accepted) if metrics else [],
            "spec_drafted": list(metrics.per_step_drafted) if metrics else []}


def states_file(sampling_params: dict | None) -> str | None:
    """The hidden-states file a request names (vllm_hidden_states.ExtractRequests), if any."""
    transfer = ((sampling_params or {}).get("extra_args") or {}).get("kv_transfer_params") or {}
    return transfer.get("hidden_states_path")


def rank_cores(cores: list[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` tensor-parallel ranks over these cores: each
    rank its own contiguous share ("0|1", "0,1,2,3|4,5,6,7"); cores left over go unused."""
    if len(cores) < ranks:
        raise ValueError(f"tensor_parallel_size {ranks} needs a core per rank; this replica may use "
                         f"{len(cores)} ({cores})")
    share = len(cores) // ranks
    groups = [cores[i * share:(i + 1) * share] for i in range(ranks)]
    return "|".join(",".join(map(str, g)) for g in groups)


def threads_bind(cores: list[int], ranks: int, threads: int | None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine of `ranks` ranks on `threads` (None: all) of
    these cores, the lowest first."""
    return rank_cores(cores[:threads] if threads else cores, ranks)


BIND = "VLLM_CPU_OMP_THREADS_BIND"


def bind_groups(value: str, ranks: int) -> list[list[int]]:
    """The cores of each of the first `ranks` groups of a VLLM_CPU_OMP_THREADS_BIND value as
    vLLM's CPU build reads it (groups `|`-separated, each comma-separated core ids or `a-b`
    ranges, int() of each); ConfigError naming the variable, its value, what is wrong and
    the form it must have. vLLM's own misreading of a value ends its engine with `Failed core
    proc(s): {}` after its start, the cause only in the replica's log (issue 55, case 14)."""
    groups = value.split("|")
    if len(groups) < ranks:
        refuse_bind(value, ranks, f"it has {len(groups)} group{'s' if len(groups) != 1 else ''} of cores "
                                  f"for {ranks} ranks")
    cores = [group_cores(group) for group in groups[:ranks]]
    for n, (group, found) in enumerate(zip(groups, cores), 1):
        if isinstance(found, str):
            refuse_bind(value, ranks, f"group {n} ({group!r}): {found}")
    return cores


def refuse_bind(value: str, ranks: int, problem: str) -> None:
    """ConfigError: the value, what is wrong with it, and the form it must have."""
    example = ("`0-3` for 1 rank on 4 cores" if ranks == 1 else
               f"`{'|'.join(map(str, range(ranks)))}` for {ranks} ranks on a core each")
    raise ConfigError(
        f"{BIND}={value!r} cannot bind the engine's {ranks} rank{'s' if ranks != 1 else ''} (tensor x pipeline "
        f"parallel size): {problem}. It must be one group of cores per rank, `|`-separated, each core ids or "
        f"ranges ({example}, `0,2-3|1` for 2 ranks), or `auto` (a NUMA node per rank) or `nobind`; or leave it "
        f"unset (engine.cpu_threads binds the replica's cores)")


def group_cores(group: str) -> list[int] | str:
    """One group's cores, or what is wrong with it."""
    if not group.strip():
        return "it is empty"
    cores = []
    for item in group.split(","):
        if not item.strip():
            return "it holds an empty item"
        ends = item.split("-")
        try:
            bounds = [int(e) for e in ends]
        except ValueError:
            return f"{item!r} is not a core id or a range of them"
        if len(bounds) > 2:
            return f"{item!r} is not a core id or a range of them"
        if bounds[0] > bounds[-1]:  # ("-1" is no int: a negative id is refused above)
            return f"the range {item!r} holds no core"
        cores += range(bounds[0], bounds[-1] + 1)
    return cores


def check_threads_bind(ranks: int, usable: set[int] | None = None) -> None:
    """A set VLLM_CPU_OMP_THREADS_BIND that vLLM's CPU build cannot use is refused
    (bind_groups); with `usable` (in the replica: the cores its process may run on), one
    naming a core outside them too (OpenMP would drop it, and the rank run unbound)."""
    value = os.environ.get(BIND)
    if value is None or value.strip() in ("auto", "nobind"):
        return
    groups = bind_groups(value, ranks)
    outside = sorted({c for g in groups for c in g} - usable) if usable is not None else []
    if outside:
        raise ConfigError(f"{BIND}={value!r} binds cores {outside}, which this engine replica may not use "
                          f"(it may use {sorted(usable)}, on its node): name cores of every node a replica may "
                          f"run on, or leave it unset (engine.cpu_threads binds the replica's cores)")


def bind_cpu_threads(ranks: int, threads: int | None) -> None:
    """On vLLM's CPU build, bind the engine's OpenMP threads to `threads` (None: all) of the
    cores this process may use, one contiguous share per rank, unless
    VLLM_CPU_OMP_THREADS_BIND is set already (it is then vLLM's, as the user gave it, once
    check_threads_bind has found it usable here).
    vLLM's own binding ("auto") binds a rank to the cores of one NUMA node each, less one
    core kept for its scheduler process: half of a 2-core machine, which on a real model
    halves the engine (docs/development.md, "vLLM on CPU: the settings"); with more than
    one rank on a one-node machine it refuses to start."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    if BIND in os.environ:
        check_threads_bind(ranks, os.sched_getaffinity(0))
        return
    os.environ[BIND] = threads_bind(sorted(os.sched_getaffinity(0)), ranks, threads)


def stop_output_handler(engine, timeout_s: float = 5) -> None:
    """Cancel AsyncLLM's output-reading task and wait until it has stopped."""
    import asyncio

    handler = getattr(engine, "output_handler", None)
    if handler is None or handler.done():
        return
    loop = handler.get_loop()
    try:
        on_loop = asyncio.get_running_loop() is loop
    except RuntimeError:
        on_loop = False
    if on_loop or not loop.is_running():
        handler.cancel()  # takes effect before the task runs again
        return
    loop.call_soon_threadsafe(handler.cancel)
    deadline = time.monotonic() + timeout_s
    while not handler.done() and time.monotonic() < deadline:
        time.sleep(0.01)
