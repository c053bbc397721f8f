"""The stages between prompts/ and the engine: a turn's rows, and each row's request."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.compute as pc
import ray

from eagle_data.config import Config
from eagle_data.job.stages.columns import Stage, columns
from eagle_data.job.variants import variants
from eagle_data.storage.contract import SAMPLING_TYPE, turn_sample_ids


class FirstTurn(Stage):
    """prompts/ rows (one per conversation) -> turn 0's rows not finished yet."""

    reads = columns("sample_id")
    makes = columns("sample_id", "conversation_id", "turn")

    def __init__(self, policy: str, finished: ray.ObjectRef):
        self.policy, self.finished = policy, finished  # finished: sample_ids, put once by the driver

    def apply(self, batch: pa.Table) -> pa.Table:
        return self.unfinished(batch)

    def unfinished(self, batch: pa.Table) -> pa.Table:
        conversation_ids = batch.column("sample_id")
        if self.policy == "all":
            batch = batch.set_column(batch.schema.get_field_index("sample_id"), "sample_id",
                                     turn_sample_ids(conversation_ids, 0))
        batch = (batch.append_column("conversation_id", conversation_ids)
                 .append_column("turn", pa.array([0] * batch.num_rows, pa.int32())))
        return batch.filter(pc.invert(pc.is_in(batch.column("sample_id"), value_set=ray.get(self.finished))))


class Askable(Stage):
    """The turns whose conversation goes on (no stop `reason`)."""

    reads = columns("reason")

    def apply(self, batch: pa.Table) -> pa.Table:
        return batch.filter(pc.equal(batch.column("reason"), ""))


class Requests(Stage):
    """Each row's engine request: its variant's sampling parameters with its own seed, and
    the exact values as the `sampling` column data/ records."""

    reads = columns("sample_id", "variant", "tokenized_prompt")
    makes = columns("sample_id", "tokenized_prompt", "sampling_params", "sampling")

    def __init__(self, sampling: dict[str, dict], seed: int, stop_ids: list[int]):
        self.sampling, self.seed, self.stop_ids = sampling, seed, stop_ids  # sampling: engine_sampling()

    def apply(self, batch: pa.Table) -> pa.Table:
        params = [
            {**self.sampling[variant], "seed": row_seed(self.seed, sid), "stop_token_ids": self.stop_ids,
             "detokenize": False}  # postprocess decodes; the engine need not
            for sid, variant in zip(batch.column("sample_id").to_pylist(), batch.column("variant").to_pylist())
        ]
        recorded = pa.array([{k: p[k] for k in SAMPLING_TYPE.names} for p in params], SAMPLING_TYPE)
        return batch.append_column("sampling_params", pa.array(params)).append_column("sampling", recorded)


def row_seed(seed: int, sample_id: str) -> int:
    """Per-sample seed: reruns reproduce a sample whatever batch it lands in (on vLLM). The
    whole id is hashed: the turns of a conversation share its prefix."""
    digest = int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=4).digest(), "big")
    return (seed * 1_000_003 + digest) % (2**31 - 1)


def engine_sampling(cfg: Config) -> dict[str, dict]:
    """Each variant's sampling parameters for the engine (a row's seed is added per row)."""
    logprobs = {"logprobs": cfg.sampling.logprobs} if cfg.sampling.logprobs else {}  # vLLM: top-k per token
    return {name: {**v.sampling, **logprobs} for name, v in variants(cfg).items()}
