"""Finding and loading the target's tokenizer (and, for the transformers backend, its weights).

A model path is a hub id, a local folder, a local `.gguf` file, or `package:NAME/FILE` for a
file shipped inside an installed Python package (the demo's SmolLM2 GGUF comes that way).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import socket
import sys
import urllib.parse
import re
from dataclasses import dataclass

from eagle_data.errors import DamagedModel, EagleDataError, MissingInput


def resolve_model_path(path: str) -> str:
    if path.startswith("package:"):
        package, _, rest = path.removeprefix("package:").partition("/")
        # find_spec locates the package without importing it: a data-only install (the
        # demo model's package is installed without its own dependencies) must not run
        # the package's __init__.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise MissingInput(f"model path {path!r}: Python package {package!r} is not installed")
        return os.path.join(list(spec.submodule_search_locations)[0], rest)
    return path


def pretrained_args(path: str) -> tuple[str, dict]:
    """(name_or_dir, extra kwargs) for `from_pretrained`: a .gguf file is loaded from its folder."""
    path = resolve_model_path(path)
    if path.endswith(".gguf"):
        return os.path.dirname(path) or ".", {"gguf_file": os.path.basename(path)}
    return path, {}


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str, trust_remote_code: bool = False):
    """Loaded once per process: Ray reuses worker processes, so each worker loads it once."""
    from transformers import AutoTokenizer

    name, kwargs = pretrained_args(path)
    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)


def is_hub_id(path: str) -> bool:
    """`name` or `org/name` that is not a local path: the hub's. A relative path with more
    parts, or whose first part is a local folder, is a local path."""
    resolved = resolve_model_path(path)
    if path.startswith("package:") or resolved.startswith((".", "/", "~")) or resolved.endswith(".gguf"):
        return False
    parts = resolved.split("/")
    return not os.path.exists(resolved) and len(parts) <= 2 and not (len(parts) == 2 and os.path.isdir(parts[0]))


def check_tokenizer_path(path: str) -> None:
    """Fail fast, before any Ray work, on a local path that does not exist."""
    resolved = resolve_model_path(path)
    if not is_hub_id(path) and not os.path.exists(os.path.expanduser(resolved)):
        raise MissingInput(f"model/tokenizer path {path!r} does not exist ({resolved})")


def check_weights(path: str) -> None:
    """Fail fast, before any Ray work, on a local model folder whose safetensors files do not
    hold what their headers say (a truncated download): the engines and the draft trainer's
    workers would each fail on it later, one traceback per actor. Reads the headers only."""
    folder = os.path.expanduser(resolve_model_path(path))
    if not os.path.isdir(folder):
        return  # a hub id or a single (GGUF) file
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            try:
                safetensors_header(os.path.join(folder, name))
            except ValueError as e:
                raise DamagedModel(f"model.path {path!r}: {name} {e}; download or convert the model again") from None


# safetensors' dtypes and their bytes per element (the format's spec, huggingface/safetensors).
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                      "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def safetensors_header(file: str) -> dict:
    """A safetensors file's header (each tensor's dtype, shape and byte range), checked
    against the file itself without reading a tensor: a ValueError saying what is wrong,
    worded to follow the file's name (`is truncated (N bytes; its header says M)`, `is not
    a readable safetensors file (...)`). An OSError where the file cannot be read at all."""
    size = os.path.getsize(file)

    def unreadable(why: str) -> ValueError:
        return ValueError(f"is not a readable safetensors file ({why})")

    with open(file, "rb") as f:
        if size < 8:
            raise unreadable(f"{size} bytes, fewer than the 8 of its header's length")
        length = int.from_bytes(f.read(8), "little")
        if 8 + length > size:  # random bytes, or a file cut inside its header
            raise unreadable(f"a header of {length} bytes in a file of {size}")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:  # not UTF-8, or not JSON
            raise unreadable(f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise unreadable("its header is not a JSON object")
    end = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        try:
            itemsize = SAFETENSORS_DTYPES[tensor["dtype"]]
            begin, stop = tensor["data_offsets"]
            shape = tensor["shape"]
            if not (all(isinstance(n, int) and n >= 0 for n in shape) and isinstance(begin, int)
                    and isinstance(stop, int) and 0 <= begin <= stop and stop - begin == math.prod(shape) * itemsize):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise unreadable(f"tensor {name!r} has no valid dtype, shape and data_offsets: {tensor}") from None
        end = max(end, stop)
    if 8 + length + end > size:
        raise ValueError(f"is truncated ({size} bytes; its header says {8 + length + end})")
    return header


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model/dataset hub answers a TCP connect (HF_ENDPOINT), in seconds, not
    the minute of retries a download takes to fail."""
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def use_hub_cache_only() -> None:
    """The hub is unreachable: read hub ids from the local cache only (a miss fails at once).
    Set in the environment (Ray workers started later inherit it) and in the libraries that
    read it at import."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    for module in ("huggingface_hub.constants", "datasets.config"):
        loaded = sys.modules.get(module)
        if loaded is not None:
            loaded.HF_HUB_OFFLINE = True


def single_token_id(tokenizer, text: str) -> int | None:
    """The id of `text` if the tokenizer has it as one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids the pipeline acts on, looked up from the tokenizer by their strings."""

    eos_ids: tuple[int, ...]
    pad_id: int
    reasoning_start_id: int | None
    reasoning_end_id: int | None

    def to_dict(self) -> dict:
        return {
            "eos_ids": list(self.eos_ids),
            "pad_id": self.pad_id,
            "reasoning_start_id": self.reasoning_start_id,
            "reasoning_end_id": self.reasoning_end_id,
        }


def special_tokens(tokenizer, reasoning_start: str, reasoning_end: str,
                   generation_eos: list[int] | int | None = None) -> SpecialTokens:
    eos = set()
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    if generation_eos is not None:
        eos.update([generation_eos] if isinstance(generation_eos, int) else generation_eos)
    if not eos:
        raise EagleDataError("the tokenizer defines no eos token and the model no eos_token_id: "
                             "set eos_token in the tokenizer config or eos_token_id in generation_config.json")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    return SpecialTokens(
        eos_ids=tuple(sorted(eos)),
        pad_id=pad,
        reasoning_start_id=single_token_id(tokenizer, reasoning_start),
        reasoning_end_id=single_token_id(tokenizer, reasoning_end),
    )


def model_config(path: str, trust_remote_code: bool = False) -> tuple[dict | None, str]:
    """(the model's config as a dict, where it was read); (None, why) when there is none."""
    name, kwargs = pretrained_args(path)
    config_file = os.path.join(name, "config.json")
    if not kwargs and os.path.isfile(config_file):
        with open(config_file) as f:
            return json.load(f), config_file
    if not is_hub_id(path) and not os.path.exists(os.path.expanduser(resolve_model_path(path))):
        # transformers would take it for a hub id and say "Repo id must be in the form ..."
        return None, f"{path!r} does not exist (no such file or folder)"
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs).to_dict(), f"{path} config"
    except (OSError, ValueError) as e:
        text = " ".join(str(e).split())
        return None, f"no model config at {path!r} ({type(e).__name__}: {text[:300]})"


def text_config_value(config: dict, key: str):
    """`key` of the config, or of its text model's for a multimodal one (Kimi-K2.5)."""
    return config.get(key) or (config.get("text_config") or {}).get(key)


def model_vocab_size(path: str, trust_remote_code: bool = False) -> tuple[int | None, str]:
    """(the target's embedding rows, where that was read): `vocab_size` of the model's
    config (of its text model for a multimodal one), which can exceed len(tokenizer) (Qwen3:
    151936 vs 151669). A draft's t2d must have this length. (None, why) when unknown."""
    config, where = model_config(path, trust_remote_code)
    if config is None:
        return None, where
    value = text_config_value(config, "vocab_size")
    return (int(value), f"{where} vocab_size") if value else (None, f"{where} vocab_size: not set")


def generation_eos_ids(path: str, trust_remote_code: bool = False) -> list[int] | int | None:
    """eos_token_id from the model's generation_config, which may list more than the tokenizer."""
    from transformers import GenerationConfig

    name, kwargs = pretrained_args(path)
    if kwargs:  # GGUF files carry no generation config
        return None
    try:
        return GenerationConfig.from_pretrained(name, trust_remote_code=trust_remote_code).eos_token_id
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=4)
def control_token_pattern(path: str, trust_remote_code: bool, extra: tuple[str, ...] = ()):
    """Regex matching any string the tokenizer turns into a control token (added tokens).

    User text containing one would smuggle a role switch or a reasoning marker into the
    prompt, so such rows are skipped instead of tokenized.
    """
    tokenizer = load_tokenizer(path, trust_remote_code)
    strings = {t.content for t in tokenizer.added_tokens_decoder.values()}
    strings.update(tokenizer.all_special_tokens)
    strings.update(s for s in extra if single_token_id(tokenizer, s) is not None)
    strings.discard("")
    # Longest first, so the reported match is the whole token.
    return re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)))
