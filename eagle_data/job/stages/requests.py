"""The stages between OUT and an engine: a turn's rows, each row's request, and the data/ rows
the hidden-states engine takes."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.compute as pc
import ray

from eagle_data.config import Config
from eagle_data.job.stages.columns import Stage, columns
from eagle_data.job.variants import variants
from eagle_data.storage.contract import SAMPLING_TYPE, turn_sample_ids


class UnfinishedFirstTurns(Stage):
    """prompts/ rows (one per conversation) -> turn 0's rows (with their conversation_id and
    turn), less those already finished."""

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


class DropStoppedTurns(Stage):
    """Keeps the turns whose conversation goes on (no stop `reason`)."""

    reads = columns("reason")

    def apply(self, batch: pa.Table) -> pa.Table:
        return batch.filter(pc.equal(batch.column("reason"), ""))


class Requests(Stage):
    """Each row's engine request: its variant's sampling parameters with its own seed, and
    the exact values as the `sampling` column data/ records (null when `sampled` is False:
    the dataset's own answers, which nothing sampled; their requests say where to cut them)."""

    reads = columns("sample_id", "variant", "tokenized_prompt")
    makes = columns("sample_id", "tokenized_prompt", "sampling_params", "sampling")

    def __init__(self, sampling: dict[str, dict], seed: int, stop_ids: list[int], sampled: bool = True):
        self.sampling, self.seed, self.stop_ids = sampling, seed, stop_ids  # sampling: engine_sampling()
        self.sampled = sampled

    def apply(self, batch: pa.Table) -> pa.Table:
        params = [
            {**self.sampling[variant], "seed": row_seed(self.seed, sid), "stop_token_ids": self.stop_ids,
             "detokenize": False}  # postprocess decodes; the engine need not
            for sid, variant in zip(batch.column("sample_id").to_pylist(), batch.column("variant").to_pylist())
        ]
        recorded = pa.array([{k: p[k] for k in SAMPLING_TYPE.names} if self.sampled else None for p in params],
                            SAMPLING_TYPE)
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


class HiddenStatesRequests(Stage):
    """The data/ rows still to do, each with the file vLLM's connector writes for it (under the
    run's scratch folder on the engine's node; the transformers pass writes none)."""

    reads = columns("sample_id", "input_ids")
    makes = columns("sample_id", "input_ids", "hidden_states_path")

    def __init__(self, todo: ray.ObjectRef, scratch: str):
        self.todo, self.scratch = todo, scratch

    def apply(self, batch: pa.Table) -> pa.Table:
        todo = self.todo if isinstance(self.todo, (pa.Array, pa.ChunkedArray)) else ray.get(self.todo)
        batch = batch.filter(pc.is_in(batch.column("sample_id"), todo))
        paths = pc.binary_join_element_wise(self.scratch + "/", batch.column("sample_id"), ".safetensors", "")
        return batch.append_column("hidden_states_path", paths)

