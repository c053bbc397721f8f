"""Sampled speculative decoding on vLLM 0.29's CPU build, made right.

vLLM's CPU model runner replaces the rejection sampler's Triton kernels with its own
(vllm/v1/worker/cpu_model_runner.py); its replacement of `expand_kernel`
(vllm/utils/cpu_triton_utils.py) hands the C++ kernel an int64 copy of its output and never
copies it back, so a float tensor it expands (each request's temperature, over its draft
tokens) stays as `new_empty` left it. The rejection sampler then divides the target's logits
by that garbage, in place, for every request of a batch that holds a sampled one: sampled
outputs are wrong, and so are greedy ones beside them (measured: greedy outputs with a draft
became runs of token 0 from their second token where sampled requests shared the batch;
alone, greedy batches never take that path).

Imported in each vLLM worker process (the engine kwarg `worker_extension_cls` names
`SampledSpecDecode`: vLLM imports it where the model runner lives, whatever the process start
method), this module replaces `rejection_sampler.expand_batch_to_tokens`, the one caller of
that kernel, with the same expansion in torch on vLLM's CPU platform; elsewhere (GPUs) it
changes nothing.
"""

from __future__ import annotations

import sys

import torch


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from=0,
                           replace_to=0) -> torch.Tensor:
    """Each request's value repeated over its draft tokens (`cu_num_tokens`: the running
    total of tokens per request), `replace_from` values given as `replace_to`, in x's dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


vllms_expand = None  # vLLM's own expand_batch_to_tokens, once replaced (for its test)


class SampledSpecDecode:
    """The worker extension vLLM imports into its worker (no methods: the import is the fix)."""


def _install() -> None:
    if "vllm.v1.sample.rejection_sampler" not in sys.modules and "vllm.platforms" not in sys.modules:
        return  # not in a vLLM process (a tool importing every module): nothing to replace
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import vllm.v1.sample.rejection_sampler as rejection_sampler

        global vllms_expand
        if rejection_sampler.expand_batch_to_tokens is not expand_batch_to_tokens:
            vllms_expand = rejection_sampler.expand_batch_to_tokens
            rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


_install()
