"""vLLM 0.29's CPU build and sampled speculative decoding (engines/cpu_spec_decode.py): its
replacement of the rejection sampler's expand kernel leaves a float per-request value (each
request's temperature over its draft tokens) uninitialized; ours expands it. The acceptance
job's run at temperatures 0 and 0.7 (tests/evaluation/test_acceptance_job.py) checks the
outputs: greedy ones with the draft equal the target's own in the same passes as sampled
ones (they did not: 5 of 8 before this fix, the others ending in token 0)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_vllms_cpu_expansion_of_each_requests_temperature_is_left_uninitialized_and_ours_is_right():
    import torch
    import vllm.utils.cpu_triton_utils as cpu_tl
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    from eagle_data.job.stages.engines import cpu_spec_decode

    cpu_spec_decode._install()  # as in a vLLM worker: vLLM is loaded
    assert rejection_sampler.expand_batch_to_tokens is cpu_spec_decode.expand_batch_to_tokens
    greedy = rejection_sampler.GREEDY_TEMPERATURE
    temperature = torch.tensor([0.7, greedy, 1.5], dtype=torch.float32)  # 3 requests: 2, 3 and 1 draft tokens
    cu_num_tokens = torch.tensor([2, 5, 6], dtype=torch.int32)
    expected = torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 1.5])
    saved = rejection_sampler.expand_kernel
    rejection_sampler.expand_kernel = cpu_tl.expand_kernel  # what vLLM's CPU model runner installs
    try:
        vllms = cpu_spec_decode.vllms_expand(temperature, cu_num_tokens, 6, replace_from=greedy, replace_to=1)
    finally:
        rejection_sampler.expand_kernel = saved
    assert not torch.equal(vllms, expected), vllms  # written into an int64 copy: never into its output
    ours = rejection_sampler.expand_batch_to_tokens(temperature, cu_num_tokens, 6, replace_from=greedy, replace_to=1)
    assert torch.equal(ours, expected) and ours.dtype == torch.float32
    top_k = rejection_sampler.expand_batch_to_tokens(torch.tensor([5, 0], dtype=torch.int32),
                                                     torch.tensor([0, 3], dtype=torch.int32), 3)
    assert top_k.tolist() == [0, 0, 0] and top_k.dtype == torch.int32  # a request with no draft token takes none
