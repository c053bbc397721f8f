"""torch Datasets over `Samples` (reader/samples.py) and a collate function."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from eagle_data.reader.samples import Samples


class _TorchSamples(Samples):
    def sample(self, pos: int) -> dict:
        item = super().sample(pos)
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in item.items()}


class OutDataset(_TorchSamples, Dataset):
    """Map-style: item i is the i-th sample of this rank's slice of the epoch order, whose
    length is the same on every rank (padded, or cut under drop_last: reader/samples.py).

    Use it with a DataLoader without shuffle or sampler (the order is already shuffled and
    sharded) and call set_epoch(e) before each epoch (with persistent_workers, recreate the
    DataLoader instead). Reading i = 0, 1, 2, ... reads each row group once; any other access
    order reads a whole row group per cache miss, and with num_workers > 1 every worker
    reads the row groups of its own batches (prefer OutIterableDataset for big OUTs)."""

    def __getitem__(self, i: int) -> dict:
        return self.sample(int(self.order[i]))


class OutIterableDataset(_TorchSamples, IterableDataset):
    """Iterable: streams this rank's slice of the epoch order (the same length on every
    rank); DataLoader workers split it further into contiguous parts, so each reads only its
    own row groups. Each worker batches its own part, so a rank's batch count depends only on
    its length, batch_size and num_workers: give every rank the same two and they take the
    same number of steps. Call set_epoch(e) before each epoch (with persistent_workers,
    recreate the DataLoader instead)."""

    def __iter__(self) -> Iterator[dict]:
        order = self.order
        info = get_worker_info()
        if info is not None:
            order = np.array_split(order, info.num_workers)[info.id]
        for pos in order:
            yield self.sample(int(pos))


def collate(batch: list[dict], pad_id: int, pad_to_multiple_of: int | None = None) -> dict:
    """Right-pad to the longest sample (rounded up to a multiple if asked): input_ids with
    pad_id, loss_mask and attention_mask with 0, `hidden_states` when present
    ([batch, longest, layers, H], zeros, in its own dtype), and the log-probabilities when
    present as the reader pads a prompt (ids 0, log-probabilities -inf, token_logprobs 0).
    Other keys are returned as lists."""
    longest = max(len(b["input_ids"]) for b in batch)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    out = {}
    for name, fill in (("input_ids", pad_id), ("loss_mask", 0), ("attention_mask", 0)):
        padded = torch.full((len(batch), longest), fill, dtype=torch.long)
        for i, b in enumerate(batch):
            padded[i, :len(b[name])] = b[name]
        out[name] = padded
    for name, fill in (("hidden_states", 0), ("top_logprob_ids", 0), ("top_logprobs", float("-inf")),
                       ("token_logprobs", 0)):
        if name in batch[0]:
            first = batch[0][name]
            padded = first.new_full((len(batch), longest, *first.shape[1:]), fill)
            for i, b in enumerate(batch):
                padded[i, :len(b[name])] = b[name]
            out[name] = padded
    for name in batch[0]:
        if name not in out:
            out[name] = [b[name] for b in batch]
    return out
