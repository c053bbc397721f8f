"""Stream rows (eagle_data.training.stream) as torch tensors, for a training loop. Imports
no Ray: what a worker's loop calls on each batch.

    collate(batch, pad_id, dtype)      the reader's padded batch, with hidden_states
    stream_items(batch, dtype)         its rows as (input_ids, loss_mask, hidden_states) tensors
    pack(items, hidden_size, dtype)    speculators' packed batch of such rows (the stream's, or
                                       the reader's of an OUT's hidden_states/), as its own
                                       dataset makes it
"""

from __future__ import annotations

import numpy as np

from eagle_data.storage.hidden_states import as_tensor


def row_tensors(batch: dict, i: int, dtype: str) -> tuple:
    """Row i of a numpy batch of stream rows as torch tensors: input_ids and loss_mask (int64
    [T], copies: Ray's arrays are read-only) and hidden_states ([T, layers, H] in `dtype`)."""
    import torch

    shape = [int(n) for n in batch["hidden_states_shape"][i]]
    return (torch.tensor(np.asarray(batch["input_ids"][i], dtype=np.int64)),
            torch.tensor(np.asarray(batch["loss_mask"][i], dtype=np.int64)),
            as_tensor(batch["hidden_states"][i], shape, dtype))


def collate(batch: dict, pad_id: int, dtype: str, pad_to_multiple_of: int | None = None) -> dict:
    """A batch of stream rows (numpy, as Ray Train's `iter_batches` gives it) -> the
    reader's padded torch batch: input_ids, loss_mask, attention_mask [B, T] and
    hidden_states [B, T, layers, H] in `dtype` (the config's hidden_states.dtype), with
    sample_id and epoch as lists."""
    import torch

    from eagle_data.reader.torch_datasets import collate as pad

    items = []
    for i in range(len(batch["sample_id"])):
        input_ids, loss_mask, states = row_tensors(batch, i, dtype)
        items.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "loss_mask": loss_mask,
                      "hidden_states": states, "sample_id": str(batch["sample_id"][i]),
                      "epoch": int(batch["epoch"][i])})
    return pad(items, pad_id, pad_to_multiple_of)


def stream_items(batch: dict, dtype: str) -> list[tuple]:
    """Every row of a numpy batch of stream rows as row_tensors gives it."""
    return [row_tensors(batch, i, dtype) for i in range(len(batch["sample_id"]))]


def pack(items: list[tuple], hidden_size: int, dtype) -> dict:
    """Rows (input_ids, loss_mask, hidden_states [T, layers, H]) -> speculators' packed batch
    ([1, total tokens, ...], document_ids), each row made the sample speculators' dataset
    makes from its hidden-states file and shifted by its shift_batch; no row cut, no
    padding. The states are pre-norm at every layer id, the last one the final state:
    speculators' `hidden_states[:, :-1]` (the aux input) and `verifier_last_hidden_states`."""
    import torch
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    samples = []
    for input_ids, loss_mask, states in items:
        n = len(input_ids)
        samples.append({"hidden_states": states[:, :-1].flatten(1), "verifier_last_hidden_states": states[:, -1],
                        "input_ids": input_ids, "loss_mask": loss_mask, "lengths": torch.tensor([n]),
                        "position_ids": torch.arange(n)})
    total = sum(len(sample["input_ids"]) - 1 for sample in samples)  # shift_batch drops one token a row
    packed = CollateFn(max_len=total, hidden_size=hidden_size, num_target_layers=items[0][2].shape[1] - 1,
                       dtype=dtype, preprocess=shift_batch)(samples)
    packed.pop("error_records")
    return packed
