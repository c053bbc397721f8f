"""What reaches an engine at its start: pass-through `engine.engine_kwargs` may not set what
a typed key owns, and a value an engine cannot start with is refused at config time."""

from __future__ import annotations

import pytest

from eagle_data.config import load_config
from eagle_data.errors import ConfigError

BASE = ["model.path=/m", "output.path=/o"]


@pytest.mark.parametrize("backend, kwarg, owner", [
    ("vllm", "max_model_len", "engine.max_model_len"),
    ("vllm", "trust_remote_code", "model.trust_remote_code"),
    ("vllm", "tensor_parallel_size", "engine.tensor_parallel_size"),
    ("vllm", "tokenizer", "model.tokenizer"),
    ("vllm", "model", "model.path"),
    ("transformers", "trust_remote_code", "model.trust_remote_code"),
    ("transformers", "gguf_file", "model.path"),
    ("transformers", "pretrained_model_name_or_path", "model.path"),
])
def test_a_pass_through_engine_kwarg_that_a_typed_key_owns_is_refused(backend, kwarg, owner):
    """engine_kwargs went over the typed values: `max_model_len` there gave vLLM another
    context length than the one the prompts phase skipped long prompts with."""
    from eagle_data.job.stages.engines import check_engine_kwargs

    cfg = load_config(None, BASE + [f"engine.backend={backend}", f"engine.engine_kwargs.{kwarg}=1"])
    with pytest.raises(ConfigError, match=rf"^engine.engine_kwargs.{kwarg}: set {owner} instead"):
        check_engine_kwargs(cfg)
    check_engine_kwargs(load_config(None, BASE + [f"engine.backend={backend}",
                                                  "engine.engine_kwargs.max_num_seqs=4"]))


def test_the_cpu_kv_cache_is_owned_on_cpu_only():
    from eagle_data.job.stages.engines import check_engine_kwargs
    from eagle_data.job.stages.engines.vllm_backend import engine_kwargs

    cpu = load_config(None, BASE + ["engine.device=cpu", "engine.engine_kwargs.kv_cache_memory_bytes=1024"])
    with pytest.raises(ConfigError, match="engine.engine_kwargs.kv_cache_memory_bytes: set engine.cpu_kv_cache_gib"):
        check_engine_kwargs(cpu)
    with pytest.raises(ConfigError):  # the builder refuses it too: the two cannot drift apart
        engine_kwargs(cpu)
    # On a GPU vLLM sizes its KV cache itself, and the pass-through may set it.
    gpu = load_config(None, BASE + ["engine.engine_kwargs.kv_cache_memory_bytes=1024"])
    assert engine_kwargs(gpu)["kv_cache_memory_bytes"] == 1024


def test_every_engine_kwarg_the_typed_keys_set_is_owned():
    """What the builders pass is exactly what the check knows, for every backend and device."""
    from eagle_data.job.stages.engines.kwargs import with_passed
    from eagle_data.job.stages.engines.transformers_backend import typed_from_pretrained
    from eagle_data.job.stages.engines.vllm_backend import engine_kwargs, typed_engine_kwargs

    for extra in ([], ["engine.device=cpu"], ["model.tokenizer=/t"]):
        cfg = load_config(None, BASE + extra)
        assert set(engine_kwargs(cfg)) <= set(typed_engine_kwargs(cfg))
    cfg = load_config(None, BASE + ["engine.backend=transformers", "engine.engine_kwargs.dtype=float32"])
    kwargs = with_passed(typed_from_pretrained("/m/model.gguf", True), cfg.engine.engine_kwargs)
    assert kwargs == {"pretrained_model_name_or_path": "/m", "gguf_file": "model.gguf",
                      "trust_remote_code": True, "dtype": "float32"}
    assert set(kwargs) - {"dtype"} <= set(typed_from_pretrained("/m/model.gguf", True))


def test_the_job_refuses_an_owned_engine_kwarg_before_any_work(tmp_path):
    from eagle_data.job.phases.run import run

    cfg = load_config(None, [f"model.path={tmp_path}/none", f"output.path={tmp_path}/out",
                             "engine.engine_kwargs.max_model_len=99"])
    with pytest.raises(ConfigError, match="engine.engine_kwargs.max_model_len: set engine.max_model_len instead"):
        run(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwarg", ["dtype", "torch_dtype"])
def test_a_dtype_the_engines_do_not_take_is_a_config_error(kwarg):
    """`torch_dtype: bogus` once failed only when the replica loaded the model, 48 s in."""
    with pytest.raises(ConfigError, match=rf"engine.engine_kwargs: {kwarg} 'bogus' is not a dtype the engines take"):
        load_config(None, BASE + ["engine.backend=transformers", f"engine.engine_kwargs.{kwarg}=bogus"])
    assert load_config(None, BASE + [f"engine.engine_kwargs.{kwarg}=bfloat16"]).engine.engine_kwargs[kwarg] == "bfloat16"


# Ray's message for an engine actor whose __init__ raised (shortened; the colour codes are Ray's).
ACTOR_DIED = (
    "The actor died because of an error raised in its creation task, \x1b[36mray::MapWorker(MapBatches("
    "TransformersEngine)).__init__()\x1b[39m (pid=1216, ip=192.0.2.2, actor_id=4ffb, repr=MapWorker("
    "MapBatches(TransformersEngine)))\n  File \"transformers_backend.py\", line 55, in load_model\n"
    "    model = AutoModelForCausalLM.from_pretrained(**kwargs).to(device).eval()\n"
    "ValueError: Specified `attn_implementation=\"bogus\"` is not supported.\n")


def test_an_engine_start_failure_is_its_root_cause_and_the_settings_to_check():
    from eagle_data.job.stages.engines import start_failure, start_settings

    cause = start_failure(ACTOR_DIED)
    assert cause == 'ValueError: Specified `attn_implementation="bogus"` is not supported.'
    cfg = load_config(None, BASE + ["engine.backend=transformers", "engine.engine_kwargs.attn_implementation=bogus"])
    assert start_settings(cfg, cause) == "engine.engine_kwargs.attn_implementation"
    assert "engine.engine_kwargs" in start_settings(cfg, "OSError: no such file")
    # Another actor's death (a packer, a reader) keeps its own error.
    assert start_failure(ACTOR_DIED.replace("TransformersEngine", "HiddenStatesPacker")) is None
    assert start_failure("The actor died unexpectedly before finishing this task. (TransformersEngine)") is None


@pytest.mark.slow
def test_an_engine_that_cannot_start_is_a_one_line_error(ray_local, tmp_path, tiny_qwen3):
    """The whole job on the transformers backend with a from_pretrained kwarg the model
    refuses at load: exit 2, `error: the engine could not start: <cause> (check <key>)`,
    no traceback."""
    import yaml

    from support import attached, job_cli, job_settings

    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_settings(tmp_path / "out", tiny_qwen3, source__sample=2,
                                                  engine__engine_kwargs={"attn_implementation": "bogus"})))
    result = job_cli(config, env=attached(ray_local))
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr, result.stderr[-5000:]
    assert last.startswith("error: the engine could not start: ValueError: Specified `attn_implementation=")
    assert last.endswith("(check engine.engine_kwargs.attn_implementation)")


# VLLM_CPU_OMP_THREADS_BIND (issue 55, case 14): a value vLLM's CPU build cannot use stopped the
# engine with `Failed core proc(s): {}` after its start, the cause only in the replica's log.
BAD_BINDS = [
    ("banana", 2, "it has 1 group of cores for 2 ranks"),  # the case
    ("banana", 1, r"group 1 \('banana'\): 'banana' is not a core id or a range of them"),
    ("0", 2, "it has 1 group of cores for 2 ranks"),
    ("0|1", 4, "it has 2 groups of cores for 4 ranks"),
    ("0|", 2, r"group 2 \(''\): it is empty"),
    ("", 1, r"group 1 \(''\): it is empty"),
    ("0,,1|2", 2, r"group 1 \('0,,1'\): it holds an empty item"),
    ("3-1|4", 2, r"group 1 \('3-1'\): the range '3-1' holds no core"),
    ("1-2-3|4", 2, r"group 1 \('1-2-3'\): '1-2-3' is not a core id"),
    ("0-1|x", 2, r"group 2 \('x'\): 'x' is not a core id"),
    ("0 1", 1, r"group 1 \('0 1'\): '0 1' is not a core id"),
]


@pytest.mark.parametrize("value, tp, problem", BAD_BINDS)
def test_a_threads_bind_vllm_cannot_use_is_refused_naming_it_before_any_work(monkeypatch, value, tp, problem):
    """Any value, any tensor-parallel size: the error names the variable, its value, what is
    wrong and the form it must have, at the job's start (check_engine_kwargs) and where any
    vLLM pass builds its engine stage (processor_config: the acceptance job, the stream)."""
    import re

    from eagle_data.job.stages.engines import check_engine_kwargs
    from eagle_data.job.stages.engines.vllm_backend import processor_config

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", value)
    cfg = load_config(None, BASE + ["engine.device=cpu", f"engine.tensor_parallel_size={tp}"])
    example = "`0|1` for 2 ranks on a core each" if tp == 2 else \
        "`0-3` for 1 rank on 4 cores" if tp == 1 else "`0|1|2|3` for 4 ranks on a core each"
    expected = (rf"^VLLM_CPU_OMP_THREADS_BIND={re.escape(repr(value))} cannot bind the engine's {tp} ranks? "
                rf"\(tensor x pipeline parallel size\): {problem}.*It must be one group of cores per rank, "
                rf"`\|`-separated, each core ids or ranges \({re.escape(example)}, ")
    with pytest.raises(ConfigError, match=expected) as refused:
        check_engine_kwargs(cfg)
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=expected):
        processor_config(cfg)


def test_a_threads_bind_counts_the_pipeline_stages_ranks_too(monkeypatch):
    from eagle_data.job.stages.engines import check_engine_kwargs

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    cfg = load_config(None, BASE + ["engine.device=cpu", "engine.engine_kwargs.pipeline_parallel_size=2"])
    with pytest.raises(ConfigError, match="cannot bind the engine's 2 ranks .*: it has 1 group of cores for 2 ranks"):
        check_engine_kwargs(cfg)


@pytest.mark.parametrize("value, tp", [("0|1", 2), ("0-3|4-7", 2), ("0,2-3|1", 2), (" 0 , 1 ", 1), ("auto", 2),
                                       ("nobind", 4), ("0|1|2", 2)])
def test_a_threads_bind_vllm_takes_is_left_to_it(monkeypatch, value, tp):
    """vLLM's own forms pass: groups of ids and ranges (int() of each, as vLLM reads them),
    `auto` (whose NUMA node per rank only vLLM checks, as it starts), `nobind`; groups after
    the ranks' are not read by vLLM 0.29 (it takes the first ones)."""
    from eagle_data.job.stages.engines import check_engine_kwargs

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", value)
    check_engine_kwargs(load_config(None, BASE + ["engine.device=cpu", f"engine.tensor_parallel_size={tp}"]))


def test_a_threads_bind_is_not_checked_where_vllm_does_not_read_it(monkeypatch):
    """vLLM's GPU build does not read it, nor does the transformers backend."""
    from eagle_data.job.stages.engines import check_engine_kwargs

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "banana")
    check_engine_kwargs(load_config(None, BASE + ["engine.tensor_parallel_size=2"]))
    check_engine_kwargs(load_config(None, BASE + ["engine.backend=transformers", "engine.device=cpu"]))


def test_an_engine_start_failure_names_a_threads_bind_that_is_set(monkeypatch):
    """What the check up front cannot see (vLLM's `auto` binding, a NUMA node per rank, on a
    one-node machine) ends as vLLM's `Failed core proc(s): {}`: the settings to check name
    the variable and its value; a cause that names it (a replica's own refusal) is its."""
    from eagle_data.job.stages.engines import start_settings

    cause = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    cfg = load_config(None, BASE + ["engine.device=cpu", "engine.tensor_parallel_size=2"])
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in start_settings(cfg, cause)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert ("engine.engine_kwargs, VLLM_CPU_OMP_THREADS_BIND='auto' (set in the environment: one group of cores "
            "per rank, `|`-separated, e.g. `0|1` for 2 ranks; or unset); the engine replica's log") \
        in start_settings(cfg, cause)
    assert start_settings(cfg, "ValueError: VLLM_CPU_OMP_THREADS_BIND='0|99' cannot bind ...") == \
        "VLLM_CPU_OMP_THREADS_BIND, set in the environment"


def test_the_job_refuses_a_threads_bind_vllm_cannot_use_in_one_line(tmp_path):
    """The issue's case as a user runs it: `VLLM_CPU_OMP_THREADS_BIND=banana` with tensor
    parallel 2 on vLLM's CPU build: exit 2 and one `error:` line naming the variable, before
    Ray or any engine starts (was: exit 2 after the engine's start, `the engine could not
    start ... Failed core proc(s): {}`, the cause among 4 tracebacks in the replica's log)."""
    import os

    import yaml

    from support import job_cli

    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(tmp_path / "model")}, "output": {"path": str(tmp_path / "out")},
        "engine": {"backend": "vllm", "device": "cpu", "tensor_parallel_size": 2}}))
    result = job_cli(config, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "banana"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: VLLM_CPU_OMP_THREADS_BIND='banana' cannot bind the engine's 2 ranks (tensor x pipeline parallel "
        "size): it has 1 group of cores for 2 ranks. It must be one group of cores per rank, `|`-separated")
    assert not (tmp_path / "out").exists()


def test_a_replica_refuses_a_threads_bind_of_cores_it_may_not_use(monkeypatch):
    """A value of the right form whose cores a replica's node does not have (`0|<one past
    its last core>`) passes the driver's check, which cannot know the nodes; the replica
    (vllm_udf.bind_cpu_threads, before vLLM starts) refuses it against the cores its process
    may use (OpenMP would drop the core, and the rank run unbound), and the job's one line
    then names the variable as the setting to check."""
    import os

    from eagle_data.job.stages.engines import start_settings
    from eagle_data.job.stages.engines.vllm_udf import check_threads_bind

    usable = os.sched_getaffinity(0)
    outside = max(usable) + 1
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"0|{outside}")
    check_threads_bind(2)  # the driver's check: the form only
    with pytest.raises(ConfigError, match=rf"^VLLM_CPU_OMP_THREADS_BIND='0\|{outside}' binds cores \[{outside}\], "
                                          r"which this engine replica may not use") as refused:
        check_threads_bind(2, usable)
    cfg = load_config(None, BASE + ["engine.device=cpu", "engine.tensor_parallel_size=2"])
    assert start_settings(cfg, f"ConfigError: {refused.value}") == "VLLM_CPU_OMP_THREADS_BIND, set in the environment"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(usable))))
    check_threads_bind(1, usable)
