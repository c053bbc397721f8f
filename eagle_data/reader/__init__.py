"""Read an OUT for training: lazy Parquet access, data-parallel sharding, torch Datasets, collate.

    from eagle_data.reader import OutReader, Samples    # no torch needed
    from eagle_data.reader import OutDataset, OutIterableDataset, collate   # imports torch
    from eagle_data.reader.batches import collate, pack   # the feature stream's rows -> torch

Alignment of `loss_mask` with `input_ids` (the contract every trainer must follow):

    input_ids  = prompt tokens + generated tokens          (length n)
    loss_mask  has length n, aligned 1:1 with input_ids:
        loss_mask[t] == 1  <=>  input_ids[t] is a generated token that is a training TARGET
        (mask.train_on=response: only the response tokens, not the reasoning ones)
        loss_mask[t] == 0  on every prompt token (never a target)

A next-token trainer (EAGLE-3 included) predicts input_ids[t+1] from position t, so it
shifts the mask like the labels:

    labels      = input_ids[1:]          # target of position t is input_ids[t+1]
    pred_mask   = loss_mask[1:]          # applies to predictions at positions 0..n-2
    loss        = sum(CE(logits[:-1], labels) * pred_mask) / sum(pred_mask)

So at the last prompt position p = num_prompt_tokens - 1, pred_mask[p] == 1 (it predicts
the first generated token) and at p - 1 it is 0 (it predicts the last prompt token).
vllm-project/speculators applies the same shift (src/speculators/models/eagle3/data.py:
`loss_mask = loss_mask[1:]` next to `input_ids = input_ids[1:]`).

With `hidden_states=True` (an OUT whose hidden-states phase ran) each item also has
`hidden_states` [n, n_layers, H], aligned 1:1 with input_ids: row t holds the target's
states computed at token input_ids[t], so the draft's input at position t is
hidden_states[t] and its target is input_ids[t+1] (`hidden_states[:-1]` with `labels`).
Rows without published hidden states are left out (`missing_hidden_states`); each item
reads only its own byte range (reader/samples.py says more).
"""

from eagle_data.reader.samples import OutReader, Samples, row_filter
from eagle_data.storage.files import filesystem as resolve_filesystem  # the one resolver, as the job's

_TORCH_NAMES = ("OutDataset", "OutIterableDataset", "collate")
__all__ = ["OutReader", "Samples", "resolve_filesystem", "row_filter", *_TORCH_NAMES]


def __getattr__(name: str):
    # The torch datasets import torch: only when asked for, so that the tools and a
    # trainer that does not use torch start without it.
    if name in _TORCH_NAMES:
        from eagle_data.reader import torch_datasets

        return getattr(torch_datasets, name)
    raise AttributeError(f"module 'eagle_data.reader' has no attribute {name!r}")
