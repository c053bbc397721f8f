"""The vLLM backend is a thin layer over ray.data.llm: build the processor from the
production config (no engine starts: Ray's stage builds its replicas only when a dataset
runs through it) and check that what it would run is what the config says."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from support import REPO
from eagle_data.config import load_config
from eagle_data.job.stages.engines.vllm_backend import build_vllm_processor, feed_factor, processor_config
from eagle_data.job.stages.requests import Requests, engine_sampling

KIMI = REPO / "configs" / "kimi-k2.5.yaml"
# The Kimi config puts each replica on an engine node (engine.replica_resources {eagle_engine: 1},
# which cluster.yaml's GPU nodes declare); the tests of Ray's own placement take it away.
RAYS_PLACEMENT = "engine.replica_resources={}"


@pytest.fixture
def kimi(monkeypatch):
    """The hub is unreachable here: building the processor would retry the tokenizer
    download for ~20 s. Offline, it fails at once (Ray treats that as non-fatal). The flag
    is read at import, so an already imported huggingface_hub is told too."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return load_config(KIMI)


def test_kimi_config_keeps_the_engine_fed(kimi):
    engine = kimi.engine
    assert engine.batch_size * engine.max_concurrent_batches >= \
        feed_factor(engine.batch_size) * engine.engine_kwargs["max_num_seqs"]


def test_processor_from_kimi_config(ray_local, kimi):
    processor = build_vllm_processor(kimi)
    # Chat template, tokenize and detokenize are ours: only the engine stage remains.
    assert processor.list_stage_names() == ["vLLMEngineStage"]
    stage = processor.get_stage_by_name("vLLMEngineStage")
    kwargs, engine = stage.fn_constructor_kwargs, kimi.engine
    # The config's settings reach the stage, each where Ray's stage reads it (values from the
    # config, not restated: a change to the production config is not a test failure).
    assert kwargs["model"] == kimi.model.path
    assert kwargs["engine_kwargs"]["tensor_parallel_size"] == engine.tensor_parallel_size > 1
    assert kwargs["engine_kwargs"]["max_model_len"] == engine.max_model_len
    assert kwargs["engine_kwargs"]["trust_remote_code"] is kimi.model.trust_remote_code is True
    assert {k: kwargs["engine_kwargs"][k] for k in engine.engine_kwargs} == engine.engine_kwargs  # passed through
    assert kwargs["should_continue_on_error"] is True  # a row vLLM rejects fails alone
    assert (kwargs["batch_size"], kwargs["max_concurrent_batches"]) == (engine.batch_size, engine.max_concurrent_batches)
    compute = stage.map_batches_kwargs["compute"]
    assert (compute.min_size, compute.max_size) == (engine.replicas, engine.replicas)  # a fixed pool
    assert stage.map_batches_kwargs["max_concurrency"] == engine.max_concurrent_batches

    # Our engine input satisfies the stage's contract.
    batch = pa.Table.from_pylist([{"sample_id": "abcdef0123", "source": "s", "variant": "default",
                                   "messages": [{"role": "user", "content": "hi"}],
                                   "tokenized_prompt": [1, 2, 3]}])
    rows = Requests(engine_sampling(kimi), kimi.sampling.seed, [163586])(batch).to_pylist()
    required = set(stage.get_required_input_keys())
    assert required == {"sampling_params"} and required <= set(rows[0])
    assert "tokenized_prompt" in stage.get_optional_input_keys() and "tokenized_prompt" in rows[0]
    params = rows[0]["sampling_params"]
    assert params["max_tokens"] == kimi.sampling.max_tokens and params["stop_token_ids"] == [163586]
    assert params["detokenize"] is False


def test_replicas_and_pass_through(kimi):
    cfg = load_config(KIMI, ["engine.replicas=4", "engine.engine_kwargs.kv_cache_dtype=fp8",
                             "model.tokenizer=/models/kimi-tokenizer"])
    pc = processor_config(cfg)
    assert pc.concurrency == (4, 4)
    assert pc.engine_kwargs["kv_cache_dtype"] == "fp8"
    assert pc.engine_kwargs["tokenizer"] == "/models/kimi-tokenizer"
    assert (pc.chat_template_stage, pc.tokenize_stage, pc.detokenize_stage) == (False, False, False)


def test_replica_resources_go_into_each_replicas_placement(ray_local, kimi):
    """engine.replica_resources: on vLLM, the first bundle of a replica's placement group
    (TP 8: Ray's executor makes the group), or the engine actor's own resources (TP 1)."""
    cfg = load_config(KIMI, ["engine.replica_resources={eagle_replica: 1}"])
    assert processor_config(load_config(KIMI, [RAYS_PLACEMENT])).placement_group_config is None  # Ray's default
    assert processor_config(kimi).placement_group_config["bundles"] == \
        [{"CPU": 1, "GPU": 1, "eagle_engine": 1}] + [{"CPU": 1, "GPU": 1}] * 7  # the Kimi config's: an engine node
    group = processor_config(cfg).placement_group_config
    assert group["bundles"] == [{"CPU": 1, "GPU": 1, "eagle_replica": 1}] + [{"CPU": 1, "GPU": 1}] * 7
    stage = build_vllm_processor(cfg).get_stage_by_name("vLLMEngineStage")
    make_group = stage.map_batches_kwargs["ray_remote_args_fn"]
    assert make_group.args[2]["bundles"][0]["eagle_replica"] == 1

    one_gpu = load_config(KIMI, ["engine.replica_resources={eagle_replica: 1}", "engine.tensor_parallel_size=1"])
    stage = build_vllm_processor(one_gpu).get_stage_by_name("vLLMEngineStage")
    kwargs = stage.map_batches_kwargs
    assert (kwargs["resources"], kwargs["num_gpus"]) == ({"eagle_replica": 1}, 1)


def test_cpu_device_asks_for_cpu_bundles_and_sets_the_kv_cache(kimi):
    cfg = load_config(KIMI, ["engine.device=cpu", "engine.tensor_parallel_size=1", "engine.num_cpus=3",
                             "engine.cpu_kv_cache_gib=2", RAYS_PLACEMENT])
    pc = processor_config(cfg)
    assert pc.placement_group_config["bundles"] == [{"CPU": 3, "GPU": 0}]  # as Ray normalises it
    assert pc.engine_kwargs["kv_cache_memory_bytes"] == 2 * 2**30
    # gpu (the default) leaves Ray's GPU placement and vLLM's own KV cache sizing alone.
    gpu = processor_config(load_config(KIMI, [RAYS_PLACEMENT]))
    assert not gpu.placement_group_config and "kv_cache_memory_bytes" not in gpu.engine_kwargs


def test_cpu_tensor_parallel_runs_its_ranks_as_vllm_processes_in_one_bundle(kimi):
    """The Kimi config (TP 8) on CPU: one CPU bundle per replica, and vLLM's own executor
    (Ray's default for TP > 1, its "ray" executor, asks for a GPU bundle per rank); on GPU
    Ray's default is left alone. Each rank's cores: rank_cores."""
    from eagle_data.job.stages.engines.vllm_udf import rank_cores

    cpu = processor_config(load_config(KIMI, ["engine.device=cpu", "engine.num_cpus=8", RAYS_PLACEMENT]))
    assert cpu.engine_kwargs["distributed_executor_backend"] == "mp"
    assert cpu.placement_group_config["bundles"] == [{"CPU": 8, "GPU": 0}]
    assert "distributed_executor_backend" not in processor_config(kimi).engine_kwargs
    assert rank_cores([0, 1], 2) == "0|1"
    assert rank_cores(list(range(8)), 2) == "0,1,2,3|4,5,6,7"
    assert rank_cores([2, 3, 5], 2) == "2|3"  # a share left over goes unused
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs a core per rank; this replica may use 1"):
        rank_cores([0], 2)


def test_cpu_engine_threads_are_the_replicas_cores_unless_the_user_bound_them(kimi, monkeypatch):
    """engine.cpu_threads on vLLM's CPU build: VLLM_CPU_OMP_THREADS_BIND over that many of the
    replica's cores (null: all), a share per rank; a set VLLM_CPU_OMP_THREADS_BIND is kept,
    and the engine line says which applies."""
    from eagle_data.config import ConfigError
    from eagle_data.job.stages.engines.vllm_backend import engine_summary
    from eagle_data.job.stages.engines.vllm_udf import bind_cpu_threads, threads_bind

    assert threads_bind([0, 1], 1, None) == "0,1"
    assert threads_bind([0, 1], 1, 1) == "0"
    assert threads_bind(list(range(8)), 2, 4) == "0,1|2,3"
    assert threads_bind([0, 1], 1, 4) == "0,1"  # at most the cores there are
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    bind_cpu_threads(1, None)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    cpu = ["engine.device=cpu", "engine.tensor_parallel_size=1"]
    assert engine_summary(load_config(KIMI, cpu)).endswith(", VLLM_CPU_OMP_THREADS_BIND=1 (set)")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert engine_summary(load_config(KIMI, cpu)).endswith(
        ", its threads on all of a replica's cores (engine.cpu_threads)")
    assert "threads" not in engine_summary(kimi)  # on GPUs
    with pytest.raises(ConfigError, match=r"engine.cpu_threads \(1\) is fewer than engine.tensor_parallel_size \(8\)"):
        load_config(KIMI, ["engine.device=cpu", "engine.cpu_threads=1"])


def test_no_gpu_in_the_cluster_fails_after_the_wait_instead_of_hanging(ray_local, kimi):
    import time

    from eagle_data.errors import NoReplicaResources
    from eagle_data.job.stages.engines.vllm_backend import wait_for_replica_resources

    cfg = load_config(KIMI, ["engine.resource_wait_s=1"])
    started = time.monotonic()
    with pytest.raises(NoReplicaResources, match=r"no GPU in the cluster; set engine.device=cpu") as e:
        wait_for_replica_resources(cfg, poll_s=0.2)
    assert "engine.resource_wait_s" in str(e.value) and time.monotonic() - started < 10
    cpu = ["engine.device=cpu", "engine.tensor_parallel_size=1", "engine.resource_wait_s=0"]
    # The Kimi config's replicas go to engine nodes, which a cluster not made by cluster.yaml lacks.
    with pytest.raises(NoReplicaResources, match=r"no node declares 'eagle_engine' \(engine.replica_resources\): "
                                                 r"declare it on the engine nodes \(`resources: \{eagle_engine: 1\}`"):
        wait_for_replica_resources(load_config(KIMI, cpu))
    wait_for_replica_resources(load_config(KIMI, [*cpu, RAYS_PLACEMENT]))  # the local instance has the CPU one needs


@pytest.mark.vllm
def test_the_transformers_backend_emits_rays_vllm_output_columns():
    from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMOutputData

    from eagle_data.job.stages.engines.transformers_backend import engine_output
    from eagle_data.job.stages.engines.outputs import ENGINE_ERROR_COLUMN, VLLM_OUTPUT_DEFAULTS

    assert list(VLLM_OUTPUT_DEFAULTS) == list(vLLMOutputData.model_fields)
    assert set(engine_output([1], [2], "")) == {*vLLMOutputData.model_fields, ENGINE_ERROR_COLUMN}


def test_hidden_states_pass_settings(kimi):
    from eagle_data.job.stages.engines.vllm_hidden_states import (
        CONNECTOR_CLASS, CONNECTOR_MODULE, ExtractRequests, HiddenStatesRows, hidden_states_engine_kwargs)
    from eagle_data.job.stages.engines.vllm_udf import states_file

    cfg = load_config(KIMI, ["engine.engine_kwargs.enable_prefix_caching=true", "engine.engine_kwargs.dtype=float16"])
    extra = hidden_states_engine_kwargs([2, 30, 60], "bfloat16", "/scratch")
    kwargs = processor_config(cfg, extra).engine_kwargs
    assert kwargs["dtype"] == "bfloat16"  # the pass's own setting wins over the job's
    assert kwargs["enable_prefix_caching"] is True and kwargs["max_num_seqs"] == 512  # passed through
    assert kwargs["speculative_config"]["draft_model_config"]["hf_config"] == \
        {"eagle_aux_hidden_state_layer_ids": [2, 30, 60]}
    transfer = kwargs["kv_transfer_config"]
    assert (transfer["kv_connector_module_path"], transfer["kv_connector"]) == (CONNECTOR_MODULE, CONNECTOR_CLASS)
    assert transfer["kv_connector_extra_config"] == {"shared_storage_path": "/scratch", "allow_custom_save_path": True}
    assert "speculative_config" not in processor_config(cfg).engine_kwargs  # the generate phase's is unchanged
    for ids, dtype in (([30, 2], "bfloat16"), ([2, 2], "bfloat16"), ([], "bfloat16"), ([2], "fp8")):
        with pytest.raises(ValueError):
            hidden_states_engine_kwargs(ids, dtype, "/scratch")

    batch = pa.Table.from_pylist([{"sample_id": "a", "input_ids": [1, 2, 3], "hidden_states_path": "/hs/a.st",
                                   "source": "s"}])
    rows = ExtractRequests()(batch).to_pylist()
    assert rows[0]["tokenized_prompt"] == [1, 2, 3] and rows[0]["source"] == "s"
    assert rows[0]["sampling_params"] == {"max_tokens": 1, "temperature": 0.0, "detokenize": False,
                                          "extra_args": {"kv_transfer_params": {"hidden_states_path": "/hs/a.st"}}}
    with pytest.raises(ValueError, match="absolute"):
        ExtractRequests()(batch.set_column(2, "hidden_states_path", pa.array(["a.st"])))
    answered = batch.append_column("__inference_error__", pa.array([""])).append_column(
        "generated_tokens", pa.array([[7]])).append_column("request_id", pa.array([0]))
    assert HiddenStatesRows()(answered).column_names == ["sample_id", "input_ids", "hidden_states_path", "source",
                                                         "__inference_error__", "hidden_states",
                                                         "hidden_states_shape", "hidden_token_ids"]
    assert states_file(rows[0]["sampling_params"]) == "/hs/a.st" and states_file({"max_tokens": 4}) is None


class Engine:
    """An engine's `errored`, which vLLM's AsyncLLM sets a moment after its engine died."""

    def __init__(self, dies_after_s: float | None):
        import time

        self.dies_at = None if dies_after_s is None else time.monotonic() + dies_after_s

    @property
    def errored(self) -> bool:
        import time

        return self.dies_at is not None and time.monotonic() >= self.dies_at


def generate_error(cause: Exception):
    """vLLM's EngineGenerateError as AsyncLLM.generate raises it: no message, `from` the cause."""
    from vllm.v1.engine.exceptions import EngineGenerateError

    error = EngineGenerateError()
    error.__cause__ = cause
    return error


@pytest.mark.parametrize("dies_after_s", [0.0, 0.3])
def test_a_request_failing_as_the_engine_dies_is_the_engines_death(dies_after_s):
    """vLLM's empty EngineGenerateError, from a rank dying under the engine's first request,
    becomes EngineDeadError once vLLM marks the engine dead: Ray's stage then restarts the
    replica and asks the row again (the TP-2 run's rank kill goes this way)."""
    import asyncio

    from vllm.v1.engine.exceptions import EngineDeadError

    from eagle_data.job.stages.engines.vllm_udf import engine_failure

    cause = RuntimeError("Call to get_supported_tasks method failed: a worker died")
    error = asyncio.run(engine_failure(Engine(dies_after_s), generate_error(cause), wait_s=5))
    assert isinstance(error, EngineDeadError) and "get_supported_tasks method failed" in str(error)


def test_a_request_failing_on_a_live_engine_keeps_its_cause_as_the_reason():
    """On an engine that stays up the error stays a row's failure, and its text (which the
    row's failed/ record keeps) is the cause's, not vLLM's empty message."""
    import asyncio

    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    from eagle_data.job.stages.engines.vllm_udf import engine_failure

    error = asyncio.run(engine_failure(Engine(None), generate_error(ValueError("bad logits")), wait_s=0.2))
    assert isinstance(error, EngineGenerateError) and not isinstance(error, EngineDeadError)
    assert str(error) == "ValueError: bad logits"
