"""Engine output -> training rows (a `map_batches` stage): exact tokens, reasoning split,
decoded text, finish reason, loss mask.

Stage contract: takes the engine's columns (`prompt_token_ids`, `generated_tokens`,
`__inference_error__`) + carried `sample_id`, `conversation_id`, `turn`, `source`,
`prompt_id`, `answer`, `variant`, `sampling`, `messages`; makes the `data/` columns plus `error` ("" for ok rows; failed rows keep only
the ids, source and error). `answered_by` (target | dataset) is the run's: who wrote the
answers the engine stage handed on (engines/dataset_answers.py gives the dataset's).

`input_ids = prompt_token_ids + generated_tokens`, nothing re-tokenized. The reasoning
boundary is the end-of-reasoning token id (looked up from the tokenizer by its string):
reasoning tokens are the generated tokens up to and including it, response tokens the rest.

With `logprobs` = k > 0 it also reads the engine's `top_logprob_ids`, `top_logprobs`,
`token_logprobs` (one array's bytes per row, engines/logprobs.py) and makes data/'s
fixed-size list columns of them (storage/contract.py `data_schema`), from numpy views of
the whole batch's bytes: no Python object per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pyarrow as pa

from eagle_data.config import Config
from eagle_data.job.stages.columns import Stage, columns, require
from eagle_data.job.stages.engines.logprobs import LOGPROB_BYTE_DTYPES
from eagle_data.job.stages.engines.outputs import ENGINE_ERROR_COLUMN
from eagle_data.model_files import SpecialTokens, load_tokenizer
from eagle_data.storage.contract import DATA_SCHEMA, ERROR, IDS, LOGPROB_COLUMNS, data_schema

ANSWER_OF = ("prompt_id", "answer", "variant", "sampling")  # carried from prompts/ and the request

# What the stage makes: data/'s columns and the error ("" on ok rows; a failed row keeps
# only IDS and the error).
OUT_SCHEMA = DATA_SCHEMA.append(pa.field(ERROR, pa.string()))


def out_schema(logprobs: int = 0, dtype: str = "float32") -> pa.Schema:
    """OUT_SCHEMA with data/'s log-probability columns when `logprobs` = k > 0."""
    return data_schema(logprobs, dtype).append(pa.field(ERROR, pa.string())) if logprobs else OUT_SCHEMA


def reasoning_split(prompt: np.ndarray, generated: np.ndarray,
                    start_id: int | None, end_id: int | None) -> tuple[int, int, int]:
    """(n_reasoning, lo, hi): generated[:n_reasoning] are reasoning tokens (markers
    included), generated[lo:hi] the reasoning text's tokens (markers excluded).

    Cases: the template opened the reasoning in the prompt (DeepSeek-R1, Kimi thinking),
    the model emits the start marker itself (Qwen3), no reasoning at all, and reasoning
    cut off by max_tokens before the end marker (then every generated token is reasoning).
    """
    if end_id is None:
        return 0, 0, 0
    starts = np.flatnonzero(generated == start_id) if start_id is not None else np.empty(0, int)
    ends = np.flatnonzero(generated == end_id)
    if ends.size:
        end = int(ends[0])
        first_start = starts[starts < end]
        lo = int(first_start[0]) + 1 if first_start.size else 0
        return end + 1, lo, end
    opened_in_prompt = False
    if start_id is not None:
        p_starts = np.flatnonzero(prompt == start_id)
        p_ends = np.flatnonzero(prompt == end_id)
        opened_in_prompt = p_starts.size > 0 and (p_ends.size == 0 or p_starts[-1] > p_ends[-1])
    if starts.size or opened_in_prompt:
        lo = int(starts[0]) + 1 if starts.size else 0
        return len(generated), lo, len(generated)
    return 0, 0, 0


def _list_parts(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column, offsets rebased to start at 0."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values[offsets[0]:offsets[-1]]


@dataclass(frozen=True)
class Postprocessor(Stage):
    """Engine output -> data/ rows (ok) and failed/ rows (error)."""

    reads: ClassVar = columns("prompt_token_ids", "generated_tokens", ENGINE_ERROR_COLUMN, *IDS, *ANSWER_OF, "messages")
    makes: ClassVar = columns(*OUT_SCHEMA.names)

    tokenizer_path: str
    trust_remote_code: bool
    eos_ids: tuple[int, ...]
    reasoning_start_id: int | None
    reasoning_end_id: int | None
    train_on: str  # "generated" | "response"
    logprobs: int = 0  # k: the engine's top-k log-probabilities become data/ columns
    logprobs_dtype: str = "float32"
    answered_by: str = "target"  # prompt.answers

    @classmethod
    def from_config(cls, cfg: Config, special: SpecialTokens) -> "Postprocessor":
        return cls(tokenizer_path=cfg.model.tokenizer_path, trust_remote_code=cfg.model.trust_remote_code,
                   eos_ids=special.eos_ids, reasoning_start_id=special.reasoning_start_id,
                   reasoning_end_id=special.reasoning_end_id, train_on=cfg.mask.train_on,
                   logprobs=cfg.sampling.logprobs, logprobs_dtype=cfg.sampling.logprobs_dtype,
                   answered_by=cfg.prompt.answers)

    @property
    def schema(self) -> pa.Schema:
        return out_schema(self.logprobs, self.logprobs_dtype)

    def apply(self, batch: pa.Table) -> pa.Table:
        errors = batch.column(ENGINE_ERROR_COLUMN).to_pylist()
        ok_idx = [i for i, e in enumerate(errors) if not e]
        failed_idx = [i for i, e in enumerate(errors) if e]
        parts = []
        if ok_idx:
            parts.append(self._ok_rows(batch.take(ok_idx) if failed_idx else batch))
        if failed_idx:
            failed = batch.take(failed_idx)
            parts.append(pa.table({
                **{c: failed.column(c) for c in IDS},
                ERROR: failed.column(ENGINE_ERROR_COLUMN),
            }))
        if not parts:
            return self.schema.empty_table()
        return pa.concat_tables([_conform(t, self.schema) for t in parts])

    def _ok_rows(self, batch: pa.Table) -> pa.Table:
        tokenizer = load_tokenizer(self.tokenizer_path, self.trust_remote_code)
        p_off, p_vals = _list_parts(batch.column("prompt_token_ids").cast(pa.list_(pa.int32())))
        g_off, g_vals = _list_parts(batch.column("generated_tokens").cast(pa.list_(pa.int32())))
        n = batch.num_rows
        p_len, g_len = np.diff(p_off), np.diff(g_off)
        eos = np.array(self.eos_ids, dtype=np.int32)

        # A row stopped when its last generated token is a stop token.
        stopped = (g_len > 0) & np.isin(g_vals[np.maximum(g_off[1:] - 1, 0)] if g_vals.size
                                        else np.zeros(n, np.int32), eos)
        n_reasoning = np.zeros(n, dtype=np.int32)
        reasoning_spans, response_spans = [], []
        for i in range(n):
            gen = g_vals[g_off[i]:g_off[i + 1]]
            nr, lo, hi = reasoning_split(p_vals[p_off[i]:p_off[i + 1]], gen,
                                         self.reasoning_start_id, self.reasoning_end_id)
            n_reasoning[i] = nr
            # The stop token is trained on but is not part of the text.
            end = gen.size - int(stopped[i])
            reasoning_spans.append(gen[lo:min(hi, end)])
            response_spans.append(gen[nr:end] if nr < gen.size else gen[:0])
        # One decode per numpy span: batch_decode checks list elements in Python, which cost
        # more than decoding (docs/performance.md, "The postprocess"); its defaults passed explicitly.
        reasoning = [_decode(tokenizer, span) for span in reasoning_spans]
        response = [_decode(tokenizer, span) for span in response_spans]
        finish = np.where(stopped, "stop", "length")

        # input_ids = prompt + generated for every row, built as one flat array: a prompt
        # token moves right by the generated tokens of earlier rows, a generated token by
        # the prompt tokens of its own and earlier rows.
        rows_p = np.repeat(np.arange(n), p_len)
        rows_g = np.repeat(np.arange(n), g_len)
        out_off = p_off + g_off
        p_pos = np.arange(p_vals.size) + g_off[rows_p]
        g_pos = np.arange(g_vals.size) + p_off[rows_g + 1]
        ids = np.empty(p_vals.size + g_vals.size, dtype=np.int32)
        ids[p_pos], ids[g_pos] = p_vals, g_vals
        mask = np.zeros(ids.size, dtype=np.int8)
        if self.train_on == "generated":
            mask[g_pos] = 1
        else:  # "response": reasoning tokens are context only
            within = np.arange(g_vals.size) - g_off[rows_g]
            mask[g_pos[within >= n_reasoning[rows_g]]] = 1

        offsets = pa.array(out_off.astype(np.int32))
        return pa.table({
            **{c: batch.column(c) for c in (*IDS, *ANSWER_OF, "messages")},
            "answered_by": pa.array([self.answered_by] * n, pa.string()),
            "reasoning": pa.array(reasoning, pa.string()),
            "response": pa.array(response, pa.string()),
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids)),
            "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask)),
            "num_prompt_tokens": pa.array(p_len.astype(np.int32)),
            "num_reasoning_tokens": pa.array(n_reasoning),
            "num_response_tokens": pa.array((g_len - n_reasoning).astype(np.int32)),
            "finish_reason": pa.array(finish.tolist(), pa.string()),
            ERROR: pa.array([""] * n, pa.string()),
            **(self._logprob_columns(batch, g_off) if self.logprobs else {}),
        })

    def _logprob_columns(self, batch: pa.Table, g_off: np.ndarray) -> dict:
        """data/'s log-probability columns, one entry per generated token (g_off: the
        generated tokens' offsets), from the engine's per-row array bytes."""
        require("stage Postprocessor (sampling.logprobs)", batch, LOGPROB_COLUMNS)
        k, tokens = self.logprobs, np.diff(g_off)
        offsets = pa.array(g_off.astype(np.int32))
        made = {}
        for name, dtype in zip(LOGPROB_COLUMNS, LOGPROB_BYTE_DTYPES):
            width = 1 if name == "token_logprobs" else k
            byte_off, data = _binary_parts(batch.column(name))
            lengths = np.diff(byte_off)
            if not np.array_equal(lengths, tokens * width * 4):
                row = int(np.flatnonzero(lengths != tokens * width * 4)[0])
                raise ValueError(f"engine column {name} of sample {batch.column('sample_id')[row]}: {lengths[row]} "
                                 f"bytes for {tokens[row]} generated tokens x {width} (sampling.logprobs = {k})")
            values = data.view(dtype) if data.ctypes.data % 4 == 0 else data.copy().view(dtype)
            if name == "top_logprobs" and self.logprobs_dtype == "float16":
                values = values.astype(np.float16)
            values = pa.array(values)
            made[name] = pa.ListArray.from_arrays(offsets, values if width == 1 else
                                                  pa.FixedSizeListArray.from_arrays(values, k))
        return made


def _decode(tokenizer, span: np.ndarray) -> str:
    return tokenizer.decode(span, skip_special_tokens=False, clean_up_tokenization_spaces=None).strip()


def _binary_parts(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(byte offsets from 0, the bytes as uint8) of a binary column with no nulls."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if arr.null_count:
        raise ValueError("an ok row of the engine's output has no log-probabilities (null)")
    arr = arr.cast(pa.large_binary())
    _, offsets, data = arr.buffers()
    offsets = np.frombuffer(offsets, np.int64)[arr.offset:arr.offset + len(arr) + 1]
    data = np.frombuffer(data, np.uint8) if data is not None else np.empty(0, np.uint8)
    return offsets - offsets[0], data[offsets[0]:offsets[-1]]


def _conform(table: pa.Table, schema: pa.Schema = OUT_SCHEMA) -> pa.Table:
    """Fill the columns a part lacks with nulls and cast to `schema`."""
    columns = [
        table.column(f.name).cast(f.type) if f.name in table.column_names
        else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)
