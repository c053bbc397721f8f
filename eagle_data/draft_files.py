"""A draft model's folder in speculators' format, checked before anything loads it: the
draft trainer's `final/` and `step-<N>/` (config.json, model.safetensors), as the acceptance
job hands them to vLLM and a resumed trainer reads them.

`check_draft_folder(folder, where)` reads config.json whole and model.safetensors' header
only, and raises one error naming the file and what is wrong with it: a missing file, a
folder where a file belongs, a config.json that is not a JSON object of a speculators EAGLE-3
draft, a model.safetensors that is not one or is cut short (model_files.safetensors_header).
Unchecked, each of these failed later, inside the engine or a worker: a MemoryError (random
bytes read as a header length), a JSONDecodeError (a header cut short), an AttributeError (a
config.json holding a list), an engine that started and then failed with five tracebacks (a
file cut in its tensors).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from eagle_data.errors import DamagedModel, MissingInput
from eagle_data.model_files import safetensors_header

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
# config.json's keys the project reads, and the JSON type each must have when present.
CONFIG_TYPES = {"transformer_layer_config": dict, "eagle_aux_hidden_state_layer_ids": list, "draft_vocab_size": int}


@dataclass(frozen=True)
class DraftFiles:
    """A checked draft folder: its config.json, and its tensors' dtype and shape by name."""

    folder: str
    config: dict
    tensors: dict[str, dict]

    def shape(self, tensor: str) -> list[int] | None:
        return (self.tensors.get(tensor) or {}).get("shape")


def check_draft_folder(folder: str, where: str) -> DraftFiles:
    """`folder` as a speculators EAGLE-3 draft, or an error (exit 2) starting with `where`
    (the setting that named it, e.g. `acceptance.drafts.mine /drafts/final`) and naming the
    file and what is wrong with it."""
    again = "copy or save the draft again, or give another (the draft trainer's final/ or a step-<N>/ checkpoint)"
    if not os.path.exists(folder):
        raise MissingInput(f"{where}: does not exist: give a draft folder in speculators' format, such as the draft "
                           "trainer's final/")
    if not os.path.isdir(folder):
        raise MissingInput(f"{where}: is a file, not a draft folder: give the folder that holds {CONFIG} and {WEIGHTS}")
    config = read_config(os.path.join(folder, CONFIG), where)
    weights = os.path.join(folder, WEIGHTS)
    if not os.path.lexists(weights):
        raise MissingInput(f"{where}: {weights} is missing: not a whole draft; {again}")
    if not os.path.isfile(weights):
        raise DamagedModel(f"{where}: {weights} is not a file: not a whole draft; {again}")
    try:
        header = safetensors_header(weights)
    except OSError as e:
        raise DamagedModel(f"{where}: {weights} cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise DamagedModel(f"{where}: {weights} {e}; {again}") from None
    tensors = {name: t for name, t in header.items() if name != "__metadata__"}
    if not tensors:
        raise DamagedModel(f"{where}: {weights} holds no tensor: not a whole draft; {again}")
    return DraftFiles(folder, config, tensors)


def read_config(path: str, where: str) -> dict:
    """config.json of a speculators EAGLE-3 draft, as a dict."""
    if not os.path.lexists(path):
        raise MissingInput(f"{where}: no {CONFIG}: not a draft folder; give a folder in speculators' format, such as "
                           "the draft trainer's final/")
    if not os.path.isfile(path):
        raise DamagedModel(f"{where}: {path} is not a file")
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read())
    except OSError as e:
        raise DamagedModel(f"{where}: {path} cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # not UTF-8, or not JSON (a file cut short)
        raise DamagedModel(f"{where}: {path} is not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise DamagedModel(f"{where}: {path} holds a JSON {json_type(config)}, not an object: not a draft's config")
    if config.get("speculators_model_type") != "eagle3":
        raise MissingInput(f"{where}: not a speculators EAGLE-3 draft ({path} says speculators_model_type "
                           f"{config.get('speculators_model_type')!r}, not 'eagle3')")
    for key, kind in CONFIG_TYPES.items():
        value = config.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise DamagedModel(f"{where}: {path}: {key} is a JSON {json_type(value)}, not "
                               f"{'an object' if kind is dict else 'a list' if kind is list else 'an integer'}")
    layer_ids = config.get("eagle_aux_hidden_state_layer_ids") or []
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids):
        raise DamagedModel(f"{where}: {path}: eagle_aux_hidden_state_layer_ids {layer_ids} are not all integers")
    return config


def json_type(value) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
