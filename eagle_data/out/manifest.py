"""OUT/manifest.json: what made this OUT, and what each phase and run produced."""

from __future__ import annotations

import datetime
import hashlib
import json
import importlib.metadata
import platform

from eagle_data.config import Config
from eagle_data.out.files import read_json, write_json

SCHEMA_VERSION = 1


class OutputMismatch(RuntimeError):
    """OUT was made with a config that the current one would silently mix with."""


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def library_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in ("eagle-data", "ray", "transformers", "pyarrow", "torch", "vllm"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


class Manifest:
    def __init__(self, fs, out: str):
        self.fs, self.out = fs, out
        self.path = f"{out}/manifest.json"
        self.data = read_json(fs, self.path) or {"schema_version": SCHEMA_VERSION, "phases": {}}

    def save(self) -> None:
        self.fs.create_dir(self.out, recursive=True)
        write_json(self.fs, self.path, self.data)

    def phase(self, name: str) -> dict:
        return self.data["phases"].setdefault(name, {})

    def prompts_complete(self) -> bool:
        return self.phase("prompts").get("status") == "complete"

    def check_prompts_config(self, cfg: Config) -> None:
        """Refuse to mix prompts made under another prompt-affecting config."""
        self._check(self.phase("prompts").get("prompt_config"), prompt_config(cfg),
                    f"{self.out} holds prompts made with a different prompt config")

    def check_generate_config(self, cfg: Config) -> None:
        """Refuse to mix data generated with other model/sampling/mask settings."""
        self._check(self.phase("generate").get("generate_config"), generate_config(cfg),
                    f"{self.out}/data was generated with different settings")

    def _check(self, made: dict | None, config: dict, what: str) -> None:
        config = normalised(config)
        if made is None or made == config:
            return
        changed = sorted(k for k in set(made) | set(config) if made.get(k) != config.get(k))
        raise OutputMismatch(
            f"{what} (changed: {', '.join(changed)}); mixing them would make an inconsistent "
            "data set. Use another output.path, or rerun with --fresh to delete this OUT and "
            "start over."
        )


def prompt_config(cfg: Config) -> dict:
    """The keys that decide prompts/ and skipped/, flattened for a readable diff."""
    return {
        # per_source only when set, so OUTs made before it existed still match.
        **{f"source.{k}": v for k, v in cfg.source.model_dump().items()
           if k != "per_source" or v is not None},
        **{f"prompt.{k}": v for k, v in cfg.prompt.model_dump().items()},
        "model.tokenizer": cfg.model.tokenizer_path,
        "model.reasoning_start": cfg.model.reasoning_start,
        "model.reasoning_end": cfg.model.reasoning_end,
        "engine.max_model_len": cfg.engine.max_model_len,
        "sampling.max_tokens": cfg.sampling.max_tokens,
    }


def normalised(config: dict) -> dict:
    """As it reads back from JSON, so a stored config compares equal to a fresh one."""
    return json.loads(json.dumps(config))


def fingerprint(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def generate_config(cfg: Config) -> dict:
    """The keys that decide the content of data/ (not how fast it is made)."""
    return {
        "model.path": cfg.model.path,
        **{f"sampling.{k}": v for k, v in cfg.sampling.model_dump().items()},
        "mask.train_on": cfg.mask.train_on,
    }
