"""Stage column contracts: each stage states the columns it requires and produces, and a
batch that lacks one fails with the stage's name (as Ray's own stages' `validate_inputs`)."""

from __future__ import annotations

from typing import Iterable

import pyarrow as pa


class MissingColumns(LookupError):
    """A stage got a batch without a column it requires: a wiring bug, named. Internal, not an
    EagleDataError on purpose: the entry points let it through with its traceback."""


def require(stage: str, batch: pa.Table, columns: Iterable[str]) -> None:
    missing = [c for c in columns if c not in batch.column_names]
    if missing:
        raise MissingColumns(f"{stage} requires columns {missing}; the batch has {batch.column_names}")


# Every column a stage reads or makes, with its meaning: a stage declares its columns by
# name from here, so each has one meaning wherever it flows.
MEANING = {
    "row_id": "hash of the dataset row",
    "source": "the row's `source` (dataset subset), or where it came from",
    "raw": "the dataset row as JSON text",
    "origin": "FILE:LINE of a jsonl row (for skip details)",
    "read_error": "'REASON: why' a row could not be read: bad_encoding (not UTF-8) or bad_file ('' when it could)",
    "path": "a dataset file's path",
    "row_group": "the row group of a parquet dataset file a read task reads (0 for other files)",
    "score": "a row's seeded sample score",
    "rows": "rows of one source in a block",
    "scores": "a source's smallest sample scores in a block",
    "sample_id": "the sample's id (the conversation id, or <conversation_id>-<turn>)",
    "conversation_id": "the conversation a turn belongs to (prompt_id, or <prompt_id>.<answer>)",
    "prompt_id": "hash of what the target is asked: the prompt a conversation answers",
    "answer": "which of the prompt's sampling.answers_per_prompt conversations this is (0 = the first)",
    "variant": "the sampling variant the conversation is answered with (job/variants.py)",
    "sampling": "the exact sampling values a row was answered with, its seed included",
    "turn": "which user turn of the conversation is answered (0 = the first)",
    "messages": "the chat turns the target is asked",
    "user_turns": "the user texts the target answers, in order",
    "tokenized_prompt": "the chat template's tokens of `messages`, the engine's input",
    "num_prompt_tokens": "len(tokenized_prompt)",
    "answer_ids": "prompt.answers=dataset: the tokens the target would have generated to give the dataset's answer",
    "answered_by": "who wrote the answer: target | dataset (prompt.answers)",
    "reason": "why a row is skipped or a conversation stops ('' when it is not)",
    "detail": "where and what, for `reason`",
    "sampling_params": "the engine's sampling parameters for this row (per-row seed)",
    "prompt_token_ids": "the tokens the engine was given",
    "generated_tokens": "the tokens the engine generated",
    "__inference_error__": "the engine's error for this row ('' on success)",
    "reasoning": "the decoded reasoning",
    "response": "the decoded response",
    "input_ids": "prompt tokens + generated tokens, exactly",
    "loss_mask": "1 where input_ids[t] is a training target",
    "num_reasoning_tokens": "generated tokens up to the end of reasoning",
    "num_response_tokens": "generated tokens after it",
    "finish_reason": "stop | length",
    "top_logprob_ids": "per generated token, the target's k most likely ids by rank (sampling.logprobs = k)",
    "top_logprobs": "their log-probabilities (log_softmax of the raw logits)",
    "token_logprobs": "per generated token, the sampled token's own log-probability",
    "error": "the engine's error text (failed/ rows), or why a row's hidden states failed a check",
    "hidden_states_path": "the row's hidden-states file on its engine's node, written by vLLM's connector "
                          "(safetensors: `hidden_states` [S, n_layers, H], `token_ids` [S]) under "
                          "hidden_states.scratch_dir, read back and removed there",
    "hidden_states": "the row's hidden states as bytes, C order, [S, n_layers, H] in the phase's dtype "
                     "(null when the engine failed on the row)",
    "hidden_states_shape": "[S, n_layers, H] of `hidden_states`",
    "hidden_token_ids": "the tokens the engine computed `hidden_states` on (checked against input_ids)",
    "shard": "the hidden-states shard under OUT/.staging/ that holds this row ('' when it failed)",
    "num_tokens": "len(input_ids)",
    "epoch": "the feature stream's epoch this row is asked in (eagle_data/training/stream.py)",
    "position": "the row's place in its epoch's order, what the stream's report counts once",
}


def columns(*names: str) -> dict[str, str]:
    """name -> meaning, for a stage's `reads` / `makes`."""
    return {name: MEANING[name] for name in names}


class Stage:
    """One `map_batches` step that declares its columns, as ray.data.llm's stages do: `reads`
    (what it needs) and `makes` (what its output has), each name -> meaning. Built from
    plain arguments; `__call__` checks both sides, so a wiring mistake names the stage and
    the column instead of surfacing as a wrong row later. Other columns pass through where
    the stage says so."""

    reads: dict[str, str] = {}
    makes: dict[str, str] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        name = type(self).__name__
        require(f"stage {name}", batch, self.reads)
        out = self.apply(batch)
        if out.num_rows == 0 and out.num_columns == 0:  # nothing in, nothing out: no schema to check
            return out
        missing = [c for c in self.makes if c not in out.column_names]
        if missing:
            raise MissingColumns(f"stage {name} did not make columns {missing}; its output has {out.column_names}")
        return out

    def apply(self, batch: pa.Table) -> pa.Table:
        raise NotImplementedError
