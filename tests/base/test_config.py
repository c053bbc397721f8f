import pytest

from eagle_data.config import load_config
from eagle_data.errors import ConfigError

BASE = ["model.path=/m", "output.path=/o"]


def test_defaults_and_overrides_are_typed():
    cfg = load_config(None, BASE + ["source.sample=100", "sampling.temperature=0",
                                    "prompt.chat_template_kwargs={enable_thinking: false}",
                                    "engine.backend=transformers", "source.sample=null"])
    assert cfg.source.sample is None
    assert cfg.sampling.temperature == 0.0
    assert cfg.prompt.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.model.tokenizer_path == "/m"
    assert cfg.engine.replica_resources == {}
    assert load_config(None, BASE + ["engine.replica_resources={eagle_replica: 1}"]).engine.replica_resources \
        == {"eagle_replica": 1}


def test_yaml_file_plus_set(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: /m}\noutput: {path: /o}\nsampling: {max_tokens: 10}\n")
    cfg = load_config(f, ["sampling.max_tokens=20"])
    assert cfg.sampling.max_tokens == 20


@pytest.mark.parametrize("override, message", [
    ("source.smaple=3", "source.smaple: unknown key"),
    ("engine.replicas=two", "engine.replicas: Input should be a valid integer"),
    ("engine.backend=tgi", "engine.backend: Input should be 'vllm' or 'transformers'"),
    ("mask.train_on=all", "mask.train_on: Input should be 'generated' or 'response'"),
    ("sampling.max_tokens=20000", "sampling.max_tokens (20000) must be smaller than engine.max_model_len (16384)"),
    ("output.rows_per_shard=0", "output.rows_per_shard: Input should be greater than or equal to 1"),
    ("engine.replica_resources={GPU: 8}", "engine.replica_resources takes custom resources only, not GPU"),
    ("engine.replica_resources={eagle_replica: 0}", "engine.replica_resources.eagle_replica: Input should be greater than 0"),
])
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + [override])
    assert message in str(e.value)


def test_missing_required_key_and_bad_set_syntax():
    with pytest.raises(ConfigError, match="output: required key is missing"):
        load_config(None, ["model.path=/m"])
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(None, BASE + ["sampling.max_tokens"])
    with pytest.raises(ConfigError, match="model.path is not a section"):
        load_config(None, BASE + ["model.path.x=1"])


BAD_VALUES = "model: {path: /m}\noutput: {path: /o}\nsampling:\n  max_tokens: lots\n  temprature: 1\n"


def test_a_config_error_is_one_line_naming_the_key_and_what_is_wrong(tmp_path):
    """The `error:` line is all a user may see (a job log's last line, a `ray job` status):
    it names each key, what is wrong with its value, and where it was set (the file, a
    --set); a YAML syntax error its line, column and the text there."""
    f = tmp_path / "c.yaml"
    f.write_text(BAD_VALUES)
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {path: /m}\noutput: {path: /o\nsampling:\n  max_tokens: 3\n")
    cases = [
        (f, [], f"invalid config {f}: sampling.max_tokens: Input should be a valid integer (got 'lots'); "
                "sampling.temprature: unknown key"),
        (f, ["sampling.max_tokens=9", "engine.replicas=two"],
         f"invalid config {f}: engine.replicas: Input should be a valid integer (got 'two'), from --set "
         "'engine.replicas=two'; sampling.temprature: unknown key"),
        (None, BASE + ["sampling={a: 1, top_p: 2}"],
         "invalid config: sampling.top_p: Input should be less than or equal to 1 (got 2), from --set "
         "'sampling={a: 1, top_p: 2}'; sampling.a: unknown key, from --set 'sampling={a: 1, top_p: 2}'"),
        (None, BASE + ["sampling.max_tokens=20000"],  # a check across keys names them itself
         "invalid config: sampling.max_tokens (20000) must be smaller than engine.max_model_len (16384): "
         "no prompt would fit"),
        (broken, [], f"config {broken}: not valid YAML at line 3, column 9 ('sampling:'): expected ',' or '}}', but "
                     "got ':' (while parsing a flow mapping from line 2, column 9 ('output: {path: /o'))"),
        (None, BASE + ["sampling.max_tokens=[1"],
         "--set 'sampling.max_tokens=[1': sampling.max_tokens: not valid YAML at column 3: expected ',' or ']', "
         "but got '<stream end>' (while parsing a flow sequence from column 1)"),
    ]
    for path, overrides, expected in cases:
        with pytest.raises(ConfigError) as e:
            load_config(path, overrides)
        assert str(e.value) == expected


def test_the_jobs_error_line_names_the_key(tmp_path):
    """As a user runs the job: exit 2, and the last line, `error: ...`, names the keys."""
    from support import job_cli

    f = tmp_path / "c.yaml"
    f.write_text(BAD_VALUES)
    result = job_cli(f, "--set", "engine.replicas=two")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: invalid config {f}: engine.replicas: Input should be a valid integer (got 'two'), from --set "
        "'engine.replicas=two'; sampling.max_tokens: Input should be a valid integer (got 'lots'); "
        "sampling.temprature: unknown key")


def test_transformers_backend_refuses_tensor_parallel():
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 needs engine.backend=vllm"):
        load_config(None, BASE + ["engine.backend=transformers", "engine.tensor_parallel_size=2"])


def float_fields(annotation, loc=(), kinds=(float,)):
    """The loc of every float the config model holds, through sections, lists, dicts and
    optionals (a list item is index 0, a dict value key "k")."""
    import types
    import typing

    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in kinds:
        yield loc
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for name, field in annotation.model_fields.items():
            yield from float_fields(field.annotation, (*loc, name), kinds)
    elif origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in args:
            yield from float_fields(arg, loc, kinds)
    elif origin is list:
        yield from float_fields(args[0], (*loc, 0), kinds)
    elif origin is dict:
        yield from float_fields(args[1], (*loc, "k"), kinds)


def nested(loc, value):
    """{"a": {"b": [value]}} for loc ("a", "b", 0)."""
    for part in reversed(loc):
        value = [value] if part == 0 else {part: value}
    return value


def accepted(locs, bad, refusal) -> list:
    """The locs whose config field takes `bad`: no validation error at that loc for which
    refusal(error) holds."""
    from pydantic import ValidationError

    from eagle_data.config import Config

    taken = []
    for loc in locs:
        data = {"model": {"path": "/m"}, "output": {"path": "/o"}}
        section = nested(loc, bad)
        data[loc[0]] = {**data.get(loc[0], {}), **section[loc[0]]}
        try:
            Config.model_validate(data)
        except ValidationError as e:
            if any(err["loc"] == loc and refusal(err) for err in e.errors()):
                continue
        taken.append(loc)
    return taken


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), "1e400"])
def test_every_float_in_the_config_model_is_finite(bad):
    """Walks the whole model, so a float field added later without `Finite` fails here: an
    inf temperature once ran with exit 0 and stored uniform random tokens."""
    from eagle_data.config import Config

    locs = list(float_fields(Config))
    assert {("sampling", "temperature"), ("engine", "num_cpus"), ("engine", "cpu_kv_cache_gib"),
            ("output", "flush_seconds"), ("sampling", "variants", 0, "top_p"),
            ("engine", "replica_resources", "k")} <= set(locs)
    taken = accepted(locs, bad, lambda err: err["type"] == "finite_number")
    assert not taken, f"float fields that accept {bad!r}: {taken}"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_every_free_form_setting_refuses_a_non_finite_number_at_any_depth(bad):
    """The settings passed on as they are (to the chat template, the engine, speculators):
    `train.speculators.optimizer.lr: .nan` was accepted and failed ~100 s into training.
    Walks the whole model, so a free-form setting added later without `FreeForm` fails here."""
    import typing

    from eagle_data.config import Config

    locs = [loc[:-1] for loc in float_fields(Config, kinds=(typing.Any,))]  # loc[-1]: the dict's "k"
    assert {("prompt", "chat_template_kwargs"), ("engine", "engine_kwargs"), ("train", "speculators"),
            ("sampling", "variants", 0, "chat_template_kwargs")} <= set(locs)
    taken = accepted(locs, {"optimizer": {"betas": [0.9, bad]}},
                     lambda err: "optimizer.betas.1: Input should be a finite number" in err["msg"])
    assert not taken, f"free-form settings that accept {bad!r} inside: {taken}"
    with pytest.raises(ConfigError, match=r"train.speculators: optimizer.lr: Input should be a finite number \(got nan\)"):
        load_config(None, BASE + ["train.speculators.optimizer.lr=.nan"])


def number_fields(annotation, loc=()):
    """The loc of every int and float the config model holds (as float_fields)."""
    yield from float_fields(annotation, loc, kinds=(int, float))


@pytest.mark.parametrize("bad", [True, False])
def test_no_number_in_the_config_model_takes_a_boolean(bad):
    """`hidden_states.layer_ids: [true, 2]` and `sampling.logprobs: true` were taken as 1:
    walks the whole model, so a number field added later without `Int`/`Finite` fails here."""
    from eagle_data.config import Config

    locs = list(dict.fromkeys(number_fields(Config)))
    assert {("sampling", "logprobs"), ("hidden_states", "layer_ids", 0), ("sampling", "temperature"),
            ("sampling", "variants", 0, "weight"), ("engine", "replica_resources", "k"), ("source", "seed")} <= set(locs)
    taken = accepted(locs, bad, lambda err: err["type"] == "int_type" or "not a boolean" in err["msg"])
    assert not taken, f"number fields that accept {bad!r}: {taken}"


def test_a_boolean_number_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"hidden_states.layer_ids.0: Input should be a valid integer"):
        load_config(None, BASE + ["hidden_states.layer_ids=[true, 2]"])
    with pytest.raises(ConfigError, match="sampling.logprobs: Input should be a valid integer"):
        load_config(None, BASE + ["sampling.logprobs=true"])
    with pytest.raises(ConfigError, match=r"sampling.temperature: Input should be a number, not a boolean \(true\)"):
        load_config(None, BASE + ["sampling.temperature=true"])
    cfg = load_config(None, BASE + ["sampling.temperature=1", "sampling.min_p=1e-3", "sampling.logprobs=3"])
    assert (cfg.sampling.temperature, cfg.sampling.min_p, cfg.sampling.logprobs) == (1.0, 0.001, 3)


def test_an_infinite_setting_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="sampling.temperature: Input should be a finite number"):
        load_config(None, BASE + ["sampling.temperature=.inf"])
    with pytest.raises(ConfigError, match="output.flush_seconds: Input should be a finite number"):
        load_config(None, BASE + ["output.flush_seconds=1e400"])


def test_a_duplicate_key_at_any_depth_is_an_error_naming_it_and_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `sampling:` section silently put
    temperature and top_p back to their defaults."""
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: /m}\noutput: {path: /o}\n"
                 "sampling:\n  temperature: 0.2\n  top_p: 0.5\n"
                 "engine: {replicas: 2}\n"
                 "sampling:\n  max_tokens: 10\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'sampling' at lines 3 and 7"):
        load_config(f)
    f.write_text("model: {path: /m}\noutput: {path: /o}\n"
                 "engine:\n  engine_kwargs:\n    max_num_seqs: 4\n    max_num_seqs: 8\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'engine.engine_kwargs.max_num_seqs' at lines 5 and 6"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"--set .*duplicate key 'enable_thinking'"):
        load_config(None, BASE + ["prompt.chat_template_kwargs={enable_thinking: false, enable_thinking: true}"])
    # YAML merge keys (`<<`) legitimately override what they merge.
    f.write_text("model: {path: /m}\noutput: {path: /o}\n"
                 "sampling: {<<: {temperature: 0.2, top_p: 0.5}, temperature: 0.3}\n")
    assert load_config(f).sampling.temperature == 0.3


def test_hidden_states_finish_reason_takes_the_known_values_only():
    """A typo (`stopp`) selected no data/ row: a silent 0-row hidden-states run."""
    with pytest.raises(ConfigError, match=r"hidden_states.finish_reason.0: Input should be 'stop' or 'length'"):
        load_config(None, BASE + ["hidden_states.finish_reason=[stopp]"])
    with pytest.raises(ConfigError, match=r"hidden_states.finish_reason.1: Input should be 'stop' or 'length'"):
        load_config(None, BASE + ["hidden_states.finish_reason=[stop, STOP]"])
    assert load_config(None, BASE + ["hidden_states.finish_reason=[stop, length]"]).hidden_states.finish_reason == [
        "stop", "length"]
