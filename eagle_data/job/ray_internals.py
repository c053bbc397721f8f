"""What works around Ray 2.60 itself, on its internals (`ray.data._internal`, the
`RAY_DATA_PARQUET_BIN_PACKING_BYTES` variable, operator state) or its state API: the Ray
version check, bounded queues between the generate stream's operators (`QueuedBlocksCap`,
`bound_queues`), small Parquet read tasks, one engine batch per block, reads that hand on
each block as it comes, this job's actors (Ray's state API), the engine operator's replicas
(its operator state), Ray Data's progress output, waiting for the nodes a job needs
(`wait_for_nodes`: Ray Data and Ray Train would wait for them forever), and a local Ray
instance that its own workers can find (`init_ray`).

`check_ray_version` (called at import) compares the installed Ray with the pin in
pyproject.toml and says what to do when they differ.

Queues: Ray Data's backpressure counts object-store bytes, and prompt blocks are small
enough to be inlined into the driver's heap, so the whole OUT/prompts queued in front of
the engine and the driver's memory grew with the run (docs/performance.md, "Driver memory").
Here an operator starts no new task while `max_blocks` blocks wait after it, and the
prompts are read in tasks of about one shard (a running task's output is not held back).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from collections.abc import Callable

import pyarrow.fs as pafs
import ray

from eagle_data.errors import EagleDataError

log = logging.getLogger("eagle_data")

PINNED_RAY = "2.60.0"  # = pyproject.toml's ray pin


def check_ray_version(installed: str = ray.__version__) -> None:
    if installed != PINNED_RAY:
        log.warning("Ray %s is installed; eagle-data is built and tested on Ray %s, and %s uses "
                    "its internals (backpressure policies, the Parquet read-task size). Install "
                    "ray==%s, or check this module against the installed Ray.",
                    installed, PINNED_RAY, __name__, PINNED_RAY)


check_ray_version()
try:
    from ray.data._internal.execution.backpressure_policy import (
        ENABLED_BACKPRESSURE_POLICIES,
        ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY,
        BackpressurePolicy,
    )
except ImportError as e:
    raise EagleDataError(f"Ray {ray.__version__} lacks the backpressure-policy API of Ray {PINNED_RAY} "
                         f"({e}): install ray=={PINNED_RAY}") from None

MAX_QUEUED_BLOCKS = "eagle_data.max_queued_blocks"
EXECUTIONS: list = []  # weak references to the QueuedBlocksCap of each execution, newest last
# Ray's Parquet reader packs files into read tasks of up to this many uncompressed bytes
# (default 128 MiB: a whole small OUT/prompts in one task); read when the dataset is made.
BIN_BYTES_ENV = "RAY_DATA_PARQUET_BIN_PACKING_BYTES"
READ_TASK_BYTES = 1 << 20


class QueuedBlocksCap(BackpressurePolicy):
    """No new task for an operator while `MAX_QUEUED_BLOCKS` of its output blocks wait.

    Running tasks are not paused (a paused task keeps its CPU, which the operators after
    it may need: a deadlock on a small node), so a read task's batches count in full:
    `read_parquet_in_small_tasks` keeps read tasks small."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        EXECUTIONS.append(weakref.ref(self))  # for engine_pool: this execution's operators

    def can_add_input(self, op) -> bool:
        limit = self._data_context.get_config(MAX_QUEUED_BLOCKS)
        if limit is None:
            return True
        queued = self._topology[op].total_enqueued_output_blocks() + sum(
            self._topology[after].total_enqueued_input_blocks() for after in op.output_dependencies)
        return queued < limit


def bound_queues(ds: ray.data.Dataset, max_blocks: int) -> None:
    """Cap the blocks queued between any two operators of `ds`'s execution at `max_blocks`."""
    ctx = ds.context
    ctx.set_config(MAX_QUEUED_BLOCKS, max_blocks)
    policies = ctx.get_config(ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY, ENABLED_BACKPRESSURE_POLICIES)
    if QueuedBlocksCap not in policies:
        ctx.set_config(ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY, [*policies, QueuedBlocksCap])


def read_parquet_in_small_tasks(files: list[str], fs: pafs.FileSystem, columns: list[str]) -> ray.data.Dataset:
    """`read_parquet` in read tasks of about one prompts shard (READ_TASK_BYTES) each."""
    before = os.environ.get(BIN_BYTES_ENV)
    os.environ[BIN_BYTES_ENV] = str(READ_TASK_BYTES)
    try:
        return ray.data.read_parquet(files, filesystem=fs).select_columns(columns)
    finally:
        if before is None:
            del os.environ[BIN_BYTES_ENV]
        else:
            os.environ[BIN_BYTES_ENV] = before


def actor_nodes(class_names: tuple[str, ...]) -> list[str] | None:
    """The node ids of this job's Ray Data actors running one of `class_names` (alive or
    ended; a restarted actor on its latest node); None where Ray's state API cannot answer."""
    actors = job_actors(class_names)
    return None if actors is None else sorted({a.node_id for a in actors if a.node_id})


def job_actors(class_names: tuple[str, ...]) -> list | None:
    """This job's Ray Data actors running one of `class_names`, from Ray's state API; None
    where it cannot answer (no dashboard, e.g. a local `ray.init(include_dashboard=False)`).
    Ray Data names its actors after the operator: class `MapWorker(MapBatches(TransformersEngine))`."""
    context = ray.get_runtime_context()
    try:
        from ray.util.state import list_actors

        actors = list_actors(address=context.gcs_address, filters=[("job_id", "=", context.get_job_id())],
                             limit=10_000, raise_on_missing_output=False, timeout=10)
        # Without a dashboard the state API falls back to 127.0.0.1:8265, which may be
        # another cluster's: keep only nodes of this one.
        ours = {node["NodeID"] for node in ray.nodes()}
    except Exception as e:  # the state API is best effort: a missing record, not a failed run
        log.debug("Ray's state API did not answer: %s", e)
        return None
    return [a for a in actors if a.node_id in ours and any(f"({name})" in (a.class_name or "") for name in class_names)]


def init_ray() -> None:
    """ray.init(): join the cluster there is (RAY_ADDRESS, or the latest `ray start`'s), else
    start a local instance whose workers are told its address (RAY_ADDRESS in the job's
    runtime env; its GCS on a port chosen here). Without it, what a worker asks Ray's state
    API looks for "the" Ray instance on the machine, and beside another one fails: Ray
    Train's PlacementGroupCleaner printed "Found multiple active Ray instances" and its
    traceback into the log of a run that succeeded."""
    from ray._private import services

    if services.canonicalize_bootstrap_address(None) is not None:
        ray.init()  # joins it
        return
    start_in_rays_time(start_local_ray)


def start_in_rays_time(start: Callable[[], object], tries: int = 3) -> None:
    """start(), a local Ray start, tried up to `tries` times where it misses Ray's fixed 30 s
    wait for its raylet (a loaded machine can: the draft trainer's own start and a benchmark's
    missed it beside the test suite), after shutting down what the failed one left running.
    Any other failure is raised at once."""
    for attempt in range(1, tries + 1):
        try:
            start()
            return
        except Exception as e:
            if attempt == tries or "timed out during startup" not in str(e):
                raise
            log.warning("the local Ray instance did not start in Ray's time (%s): starting it again", e)
            ray.shutdown()


def start_local_ray() -> None:
    """A local instance whose workers are told its address (init_ray)."""
    from ray._private import services

    with socket.socket() as s:  # a free port now; the GCS binds it a moment later
        s.bind(("", 0))
        port = s.getsockname()[1]
    address = f"{services.get_node_ip_address()}:{port}"
    before = os.environ.get("RAY_GCS_SERVER_PORT")
    os.environ["RAY_GCS_SERVER_PORT"] = str(port)  # read by the local node Ray starts (ray._private.node)
    try:
        ray.init(address="local", runtime_env={"env_vars": {"RAY_ADDRESS": address}})
    finally:
        os.environ.pop("RAY_GCS_SERVER_PORT") if before is None else os.environ.update(RAY_GCS_SERVER_PORT=before)
    if ray.get_runtime_context().gcs_address != address:
        log.warning("the local Ray instance is at %s, not %s as its workers were told",
                    ray.get_runtime_context().gcs_address, address)


def undeclared_hint(resources: dict, nodes: list[dict], setting: str, role: str, per_node: int) -> str | None:
    """What to do about the custom `resources` (a config's `setting`) that no node in `nodes`
    declares, or None when every one is declared: declare them on the `role` nodes, or drop
    the setting and let Ray place them."""
    undeclared = [k for k in resources if not any(res.get(k, 0) > 0 for res in nodes)]
    if not undeclared:
        return None
    name = undeclared[0]
    return (f"no node declares {', '.join(map(repr, undeclared))} ({setting}): declare it on the {role} nodes "
            f"(`resources: {{{name}: {per_node}}}` as cluster.yaml's {role} nodes do, or "
            f"`ray start --resources '{{\"{name}\": {per_node}}}'`), or set {setting}={{}} to let Ray place them")


def wait_for_nodes(fits, wait_s: float, poll_s: float = 2.0) -> tuple[bool, list[dict]]:
    """Whether `fits(nodes)` (each alive node's resources) became true within `wait_s`
    seconds (an autoscaling cluster adds nodes meanwhile), and the nodes last seen."""
    deadline = time.monotonic() + wait_s
    while True:
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        if fits(nodes):
            return True, nodes
        if time.monotonic() >= deadline:
            return False, nodes
        time.sleep(poll_s)


def wait_for_actors_to_exit(class_names: tuple[str, ...], timeout_s: float = 60) -> None:
    """Until no actor of this job running one of `class_names` is alive (engine replicas shut
    down and their output printed before the job's summary); at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        actors = job_actors(class_names)
        if actors is None or all(a.state == "DEAD" for a in actors):
            return
        time.sleep(0.5)


def ray_data_progress(on: bool) -> None:
    """Ray Data's own progress output on or off, without its warning that it is off."""
    from ray.util.debug import log_once

    ray.data.DataContext.get_current().enable_progress_bars = on
    if not on:
        log_once("ray_data_progress_manager_disabled")  # marks Ray's one-time warning as said


def engine_pool(class_names: tuple[str, ...]) -> dict | None:
    """The engine operator of the newest running execution, from Ray Data's own operator
    state: replicas running / starting (loading the model) / restarting, and the rows handed
    to replicas and not yet back. None before the engine operator exists."""
    for ref in reversed(EXECUTIONS):
        policy = ref()
        if policy is None:
            continue
        for op in policy._topology:
            if any(f"({name})" in op.name for name in class_names) and hasattr(op, "get_actor_info"):
                info, metrics = op.get_actor_info(), op.metrics
                return {"running": info.running, "starting": info.pending, "restarting": info.restarting,
                        "rows_in_engine": metrics.rows_inputs_of_submitted_tasks - metrics.rows_task_outputs_generated}
    return None


def one_batch_per_block(ds: ray.data.Dataset, rows: int) -> ray.data.Dataset:
    """Blocks of `rows` rows: one engine batch per block, so one per engine task, whose
    output reaches the driver (and a shard) when the task ends. Strict: the non-strict
    repartition is fused into the read task and leaves its block whole (every row then
    reaches data/ at the end). It also spares Ray 2.60's vLLM stage a task mixing an
    all-failed batch with an answered one, which fails (`_backfill_missing_fields`)."""
    return ds.repartition(target_num_rows_per_block=rows, strict=True)


def read_unshaped(datasource_type: type) -> None:
    """Reads of `datasource_type` hand on each block their read function yields as it
    comes. Ray Data's read task buffers them into blocks of `target_max_block_size` (128
    MiB) and hands them on only then, or at the task's end; job/stages/feed.py's one read
    task lasts the whole run, and a turn depth's last prompt block must not wait for the
    next depth, which waits for that block's answers. Planning runs in the driver: once there."""
    from ray.data._internal.logical.operators.read_operator import Read
    from ray.data._internal.output_buffer import OutputBlockSizeOption
    from ray.data._internal.planner.planner import Planner

    plan_read = Planner._DEFAULT_PLAN_FNS[Read]
    if getattr(plan_read, "unshaped", None) is datasource_type:
        return

    def plan(op, physical_children, data_context):
        physical = plan_read(op, physical_children, data_context)
        if isinstance(op.datasource, datasource_type):
            for fn in physical._map_transformer._transform_fns:
                fn._output_block_size_option = OutputBlockSizeOption.of(disable_block_shaping=True)
        return physical

    plan.unshaped = datasource_type
    Planner._DEFAULT_PLAN_FNS[Read] = plan
