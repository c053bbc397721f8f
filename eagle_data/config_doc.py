"""docs/configuration.md, generated from the config model's field descriptions.

    python -m eagle_data.config_doc > docs/configuration.md

tests/base/test_config_doc.py fails when the file and this output differ, or a field has no
description: a new config key is documented where it is defined.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Annotated, Any, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from eagle_data.config import Config, phases_changed, settings

COMMAND = "python -m eagle_data.config_doc > docs/configuration.md"

HEADER = f"""\
# Configuration

<!-- Generated from the field descriptions in eagle_data/config.py: do not edit.
     Regenerate with `{COMMAND}`
     (tests/base/test_config_doc.py checks that this file is up to date). -->

One typed config (`eagle_data/config.py`): a YAML file (`--config FILE`, e.g.
`configs/demo.yaml`, `configs/kimi-k2.5.yaml`) plus `--set dotted.key=value` overrides on the
command line. Override values are read as YAML: `--set source.sample=null`,
`--set prompt.chat_template_kwargs={{enable_thinking: false}}`,
`--set engine.replica_resources={{eagle_replica: 1}}`.

Unknown keys, wrong types and impossible combinations stop the job at start, before Ray
starts, with the key named (exit code 2). So does a key given twice in one YAML mapping, at
any depth, in the file or a `--set` value (named with both lines: YAML would silently keep
the last one), and an infinite or NaN number in any float setting (`.inf`, `1e400`). The
combinations checked:

- `sampling.max_tokens` must be smaller than `engine.max_model_len` (no prompt would fit);
- `model.reasoning_start` and `model.reasoning_end` must differ;
- `prompt.max_turns` needs `prompt.turns: all`;
- `engine.replica_resources` takes custom resources only (not `CPU`, `GPU`, `memory`,
  `object_store_memory`: CPUs are `engine.num_cpus`, GPUs follow `engine.tensor_parallel_size`),
  and so does `train.worker_resources`;
- `engine.tensor_parallel_size > 1` needs `engine.backend: vllm`;
- `source.per_source` needs `source.sample` or `source.per_source.max_rows`, its `weights`
  need `source.sample`, and must give some source a positive weight;
- `source.fields` names different fields for `user`, `assistant` and `system`;
- `prompt.answers: dataset` takes `prompt.turns: first_user`, `sampling.answers_per_prompt: 1`,
  no `sampling.variants` and `sampling.logprobs: 0` (the dataset has one answer per prompt,
  not sampled).
- `engine.engine_kwargs` may not set what a typed key sets (`max_model_len`,
  `trust_remote_code`, ...: the prompts phase and the tokenizer use the typed value), and
  its `dtype`/`torch_dtype` must be a dtype both engines take.

An engine replica that cannot start (its model load raises) stops the job with
`error: the engine could not start: <root cause> (check <settings>)`, exit code 2.

The *changes* column says which phases' rows a key decides: a rerun on an existing OUT with
another value of it is refused, naming the changed keys, as long as that phase's rows are in
OUT (`--fresh` deletes OUT and starts over; `--fresh --phase X` deletes phase X's rows and
the later phases' only). A phase whose folders hold no row (its filter selected none) binds
nothing: the next run starts it over under the new config. *run only*: how fast, where or by what the rows
are made; a rerun may change it. A key of a nested section (`source.per_source.*`,
`sampling.variants`) is part of its section's value.

"""


def type_name(annotation: Any) -> str:
    """A field's type as a reader of the YAML sees it: `int or null`, `one of: a, b`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return "one of: " + ", ".join(f"`{a}`" for a in args)
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is dict:
        return f"mapping ({type_name(args[0])}: {type_name(args[1])})"
    if origin is list and typing.get_origin(args[0]) is Literal:
        return "list, each " + type_name(args[0])
    if origin is list and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return "list of sections (below)"
    if origin is list:
        return f"list of {type_name(args[0])}s"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
        getattr(annotation, "__name__", ""), "any" if annotation is Any else str(annotation))


def constraints(field: FieldInfo) -> str:
    """The field's bounds (`>= 1`, `> 0, <= 1`, `non-empty`), from its Field constraints."""
    found = []
    for meta in field.metadata:
        for cls, sign, sign_attr in ((annotated_types.Ge, ">=", "ge"), (annotated_types.Gt, ">", "gt"),
                                    (annotated_types.Le, "<=", "le"), (annotated_types.Lt, "<", "lt")):
            if isinstance(meta, cls):
                found.append(f"{sign} {getattr(meta, sign_attr)}")
        if isinstance(meta, annotated_types.MinLen) and meta.min_length == 1:
            found.append("non-empty")
    return ", ".join(found)


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (dict, list)):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sections(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, type[BaseModel]]]:
    """(dotted name, description, model) of every section under `model`, in field order,
    a nested section right after the one that holds it."""
    found = []
    for name, field in model.model_fields.items():
        for candidate in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                dotted = f"{prefix}{name}"
                # A nested section says what it is in its docstring; a top-level one in its field.
                intro = (vars(candidate).get("__doc__") or "").strip() if prefix else ""
                found.append((dotted, intro or field.description or "", candidate))
                found += sections(candidate, dotted + ".")
    return found


def missing_descriptions() -> list[str]:
    """Every `dotted.key` (sections included) whose field has no description."""
    missing = [name for name, field in Config.model_fields.items() if not (field.description or "").strip()]
    for dotted, _, model in sections():
        missing += [f"{dotted}.{name}" for name, field in model.model_fields.items()
                    if not (field.description or "").strip()]
    return missing


def changes_text(key: str, tags: dict[str, list[str] | None]) -> str:
    """The phases `key` locks, as the doc's column shows them; a key inside a setting's value
    (`source.per_source.max_rows`) shows that setting's."""
    while key not in tags and "." in key:
        key = key.rsplit(".", 1)[0]
    phases = tags.get(key)
    if phases is None:
        return "?"
    return ", ".join(f"`{p}`" for p in phases) or "run only"


def render() -> str:
    parts = [HEADER]
    tags = {key: phases_changed(field) for key, field in settings()}
    for dotted, description, model in sections():
        intro = description[:1].upper() + description[1:]
        parts.append(f"## `{dotted}`\n\n{intro}{'' if intro.endswith('.') else '.'}\n\n")
        parts.append("| key | type | default | changes | description |\n|---|---|---|---|---|\n")
        for name, field in model.model_fields.items():
            kind = type_name(field.annotation)
            bounds = constraints(field)
            if bounds:
                kind += f" ({bounds})"
            parts.append(f"| `{dotted}.{name}` | {cell(kind)} | {cell(default_text(field))} "
                         f"| {changes_text(f'{dotted}.{name}', tags)} | {cell(field.description or '')} |\n")
        parts.append("\n")
    return "".join(parts).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
