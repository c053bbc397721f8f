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
