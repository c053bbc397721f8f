"""What the pilot runs (docs/pilot.md): per recipe, the generate job's and the trainer's
whole config (the base config with the recipe's dotted keys set, the folders the pilot
gives it), and the acceptance job's over every draft; and which keys of a stage's config
decide what it makes (a rerun may change the others)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from eagle_data.config import Config, set_key
from eagle_data.errors import ConfigError

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# What a recipe may change: what makes its rows and its draft. Not the target, the measurement
# or the folders, which the pilot sets.
RECIPE_KEYS = ("source.", "prompt.", "sampling.", "mask.", "engine.", "hidden_states.", "stream.", "train.")
PILOT_SET = {"output.path", "train.speculators.trainer.save_path", "train.checkpoint_every",
             "hidden_states.enabled"}
# How fast or where a stage runs, not what it makes: a rerun may change them.
OPERATIONAL = {"output.log_every_s", "output.ray_data_progress", "output.flush_seconds", "output.rows_per_shard",
               "output.max_attempts", "hidden_states.rows_per_shard", "hidden_states.scratch_dir",
               "engine.resource_wait_s", "engine.replicas", "engine.batch_size", "engine.max_concurrent_batches",
               "engine.num_cpus", "engine.cpu_threads", "engine.replica_resources", "engine.cpu_kv_cache_gib",
               "stream.max_bytes_in_flight", "train.resource_wait_s", "train.max_failures",
               "train.worker_resources", "train.cpus_per_worker", "acceptance.bootstrap"}

@dataclass
class Stage:
    name: str  # generate:<recipe>, train:<recipe>, acceptance
    module: str  # ray_jobs.<job>
    config: dict  # the job's whole config
    folder: Path  # where its config file and log go

    @property
    def config_file(self) -> Path:
        return self.folder / f"{self.name.split(':')[0]}.yaml"

    @property
    def log_file(self) -> Path:
        return self.folder / f"{self.name.split(':')[0]}.log"


def draft_names(cfg: Config) -> dict[str, str]:
    """The drafts the acceptance stage measures, by name: each recipe's final draft (its name),
    and `<recipe>@<step>` for its checkpoints at pilot.measure_steps."""
    root = Path(cfg.pilot.path) / "recipes"
    drafts = {}
    measured = cfg.pilot.measure_steps_of if cfg.pilot.measure_steps_of is not None else list(cfg.pilot.recipes)
    for name in cfg.pilot.recipes:
        drafts[name] = str(root / name / "draft" / "final")
        if name in measured:
            drafts.update({f"{name}@{step}": str(root / name / "draft" / f"step-{step}")
                           for step in sorted(cfg.pilot.measure_steps)})
    return drafts


def stages(cfg: Config) -> list[Stage]:
    """Every stage of the pilot, in order, with its job's config (checked: each recipe's is a
    valid config). Raises ConfigError naming the pilot key at fault."""
    settings = cfg.pilot
    where = "pilot"
    if settings.path is None:
        raise ConfigError(f"{where}.path is not set: give an absolute folder for the pilot's OUTs, drafts and report")
    if not settings.recipes:
        raise ConfigError(f"{where}.recipes is empty: name at least one recipe, e.g. "
                          "{dataset: {prompt.answers: dataset}, greedy: {sampling.temperature: 0}}")
    if settings.held_out is None:
        raise ConfigError(f"{where}.held_out is not set: the held-out prompts the drafts are measured on, as "
                          "source: takes them, e.g. {dataset: test.jsonl, fields: {user: question}}")
    if "train" not in cfg.model_fields_set:
        raise ConfigError("the config has no `train:` section: the pilot trains every recipe's draft with it "
                          "(train.speculators with trainer.max_steps; docs/pilot.md)")
    if cfg.engine.backend != "vllm":
        raise ConfigError(f"engine.backend {cfg.engine.backend}: the pilot measures the drafts with vLLM's "
                          "speculative decoding (engine.backend: vllm; a recipe may change its own engine)")
    for name in settings.recipes:
        if not NAME.match(name):
            raise ConfigError(f"pilot.recipes: {name!r} is not a recipe name (letters, digits, _ . -; at most 64)")
    for key, names in (("measure_steps_of", settings.measure_steps_of), ("compare_to", settings.compare_to)):
        unknown = [n for n in names or () if n not in settings.recipes]
        if unknown:
            raise ConfigError(f"pilot.{key} names {', '.join(unknown)}, not among pilot.recipes "
                              f"({', '.join(settings.recipes)})")
    every = checkpoint_every(cfg)
    root = Path(settings.path)
    # What the user set, as they set it (a default written out would read as a choice: the
    # prompts phase checks a source.fields.source given explicitly against the rows).
    base = cfg.model_dump(mode="json", exclude_unset=True, exclude={"pilot"})
    measurement = base.pop("acceptance", {})
    found = []
    for name, overrides in settings.recipes.items():
        recipe = recipe_config(base, name, overrides)
        folder = root / "recipes" / name
        offline = validate(recipe, f"pilot.recipes.{name}").train.source == "hidden_states"
        put(recipe, "output.path", str(folder / "out"))
        put(recipe, "hidden_states.enabled", offline)
        put(recipe, "train.speculators.trainer.save_path", str(folder / "draft"))
        measured = settings.measure_steps_of is None or name in settings.measure_steps_of
        if measured and settings.measure_steps:
            put(recipe, "train.checkpoint_every", every)
        validate(recipe, f"pilot.recipes.{name}")
        found.append(Stage(f"generate:{name}", "ray_jobs.generate", recipe, folder))
        found.append(Stage(f"train:{name}", "ray_jobs.train_draft", recipe, folder))
    found.append(Stage("acceptance", "ray_jobs.acceptance", acceptance_config({**base, "acceptance": measurement}, cfg),
                       root))
    return found


def checkpoint_every(cfg: Config) -> int | None:
    """train.checkpoint_every for the measured recipes: as set (each measured step a multiple
    of it), else the measured steps' greatest common divisor."""
    steps = cfg.pilot.measure_steps
    if not steps:
        return cfg.train.checkpoint_every
    every = cfg.train.checkpoint_every
    if every is None:
        return math.gcd(*steps)
    off = [s for s in steps if s % every]
    if off:
        raise ConfigError(f"pilot.measure_steps {off}: not multiples of train.checkpoint_every {every}, so no "
                          "checkpoint is saved there; choose multiples of it, or unset train.checkpoint_every")
    return every


def recipe_config(base: dict, name: str, overrides: dict) -> dict:
    """The base config with a recipe's dotted keys set."""
    config = json.loads(json.dumps(base))
    for key, value in overrides.items():
        if not isinstance(key, str) or not key.startswith(RECIPE_KEYS) or key in PILOT_SET:
            why = ("the pilot sets it" if key in PILOT_SET else
                   "a recipe changes what makes its rows and its draft: " + ", ".join(k + "*" for k in RECIPE_KEYS))
            raise ConfigError(f"pilot.recipes.{name}: {key!r} cannot be changed by a recipe ({why})")
        put(config, key, value, f"pilot.recipes.{name}")
    return config


def acceptance_config(base: dict, cfg: Config) -> dict:
    """The acceptance job's config: the held-out prompts (their own OUT), every draft, the
    target's own settings as the base config has them."""
    config = json.loads(json.dumps(base))
    root = Path(cfg.pilot.path)
    config["source"] = cfg.pilot.held_out.model_dump(mode="json", exclude_unset=True)
    put(config, "output.path", str(root / "held-out"))
    put(config, "prompt.answers", "target")
    put(config, "sampling.answers_per_prompt", 1)
    put(config, "sampling.variants", [])
    put(config, "hidden_states.enabled", False)
    config["acceptance"] = {**config.get("acceptance", {}), "path": str(root / "acceptance"),
                            "drafts": draft_names(cfg)}
    validate(config, "pilot.held_out")
    return config


def put(config: dict, key: str, value, where: str = "") -> None:
    blocked = set_key(config, key.split("."), value)
    if blocked:
        raise ConfigError(f"{where}: {blocked} is not a section (setting {key})")


def validate(config: dict, where: str) -> Config:
    from pydantic import ValidationError

    try:
        return Config.model_validate(config)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg'].removeprefix('Value error, ')}"
                             for err in e.errors())
        raise ConfigError(f"{where}: the config it makes is not valid: {problems}") from None


def flat(config: dict, prefix: str = "") -> dict:
    found = {}
    for key, value in config.items():
        if isinstance(value, dict) and value and key not in ("engine_kwargs", "chat_template_kwargs"):
            found.update(flat(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found


def changed_keys(before: dict, now: dict, also_ignore: tuple = ()) -> list[str]:
    """The dotted keys that decide a stage's result and differ, as `key: before -> now`."""
    a, b = flat(before), flat(now)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in OPERATIONAL and not k.startswith(also_ignore)]
