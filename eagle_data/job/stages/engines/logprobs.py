"""The engine stage's log-probability columns.

With `sampling_params["logprobs"]` = k > 0 (from `sampling.logprobs`) each ok row also
carries, per generated token in order (T = num_generated_tokens), `top_logprob_ids` [T, k]
int32 (the target's k most likely ids at that step, by rank, best first), `top_logprobs`
[T, k] float32 (their log-probabilities) and `token_logprobs` [T] float32 (the sampled
token's own, which is one of the top k or not). Each column holds one value per row: the
array's bytes (little-endian, C order), which the postprocess stage turns into data/'s
fixed-size lists without a Python object per token (Ray's processor passes every row
through Python, where nested lists cost one per value: docs/performance.md, "Settled").
vLLM's own `logprobs` column (Ray's list of per-token dicts) stays null: the vLLM stage
takes the values from vLLM's flat container (`flat_logprob_values`). The values are vLLM's
default `logprobs_mode`, `raw_logprobs`: log_softmax of the model's raw logits in float32,
before temperature, top-p and penalties (a property of the target, not of the sampling);
the transformers backend computes the same from `generate`'s raw logits. Ties among equal
log-probabilities are ordered as torch.topk orders them, which both backends use (no
lowest-id-first rule).
"""

from __future__ import annotations

import numpy as np

from eagle_data.storage.contract import LOGPROB_COLUMNS

LOGPROB_BYTE_DTYPES = ("<i4", "<f4", "<f4")  # the numpy dtype of each of LOGPROB_COLUMNS' bytes


def logprob_values(top_ids: np.ndarray, top_logprobs: np.ndarray, token_logprobs: np.ndarray) -> dict:
    """One row's log-probability columns as the engine stage emits them (module docstring)."""
    arrays = (top_ids, top_logprobs, token_logprobs)
    return {name: np.ascontiguousarray(a, dtype).tobytes()
            for name, a, dtype in zip(LOGPROB_COLUMNS, arrays, LOGPROB_BYTE_DTYPES)}


def flat_logprob_values(completion, k: int) -> dict:
    """A vLLM 0.29 completion's log-probability columns. Its FlatLogprobs holds, per
    generated token, the sampled token's entry first and then the top k with ranks 1..k
    (vllm/logprobs.py `append_logprobs_for_next_position`), always k + 1 entries: the top k
    are entries 1..k, by rank, and the sampled token's own log-probability is entry 0."""
    flat, n = completion.logprobs, len(completion.token_ids)
    ids = np.asarray(flat.token_ids, np.int32)
    if len(flat) != n or ids.size != n * (k + 1):
        raise RuntimeError(f"vLLM returned {ids.size} log-probabilities over {len(flat)} positions for {n} "
                           f"generated tokens, not {k} + 1 per token: is this vLLM 0.29?")
    ids = ids.reshape(n, k + 1)
    values = np.asarray(flat.logprobs, np.float32).reshape(n, k + 1)
    ranks = np.asarray(flat.ranks, np.int64).reshape(n, k + 1)[:, 1:]
    if n and not ((ranks == np.arange(1, k + 1)).all() and (ids[:, 0] == np.asarray(completion.token_ids)).all()):
        raise RuntimeError("vLLM's flat log-probabilities are not laid out as in vLLM 0.29 "
                           "(the sampled token, then the top k by rank)")
    return logprob_values(ids[:, 1:], values[:, 1:], values[:, 0])
