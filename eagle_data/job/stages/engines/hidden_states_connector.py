"""vLLM's `ExampleHiddenStatesConnector`, able to run on vLLM's CPU build too.

The stock connector copies a finished request's hidden states off the device on a CUDA
stream into pinned memory, and fails on CPU (`pin_memory=True requires a CUDA or other
accelerator backend`). Here only `_submit_async_write` changes, and only on CPU: the rows
are gathered from the cache and copied right away (the request's blocks are freed once it
is reported done, which the stock code lets happen when its copy event completes), then
handed to the stock writer pool, lock protocol unchanged. On CUDA it is the stock method.

vLLM loads it by name in its spawned engine processes (`kv_connector_module_path`), so it
stays an importable module of the package.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Copied:
    """Stands in for the stock code's CUDA copy event: the copy is already done."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)

        num_tokens = pending.token_ids.shape[0]
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        # clone: a tensor of its own, not a view into cache blocks that are about to be reused.
        hidden_states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        assert pending.req_id not in self._req_futures, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # taken (LOCK_EX) in wait_for_save
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        copied = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, copied, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
