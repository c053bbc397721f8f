"""vLLM 0.29's CPU build and sampled speculative decoding (engines/cpu_spec_decode.py): its
replacement of the rejection sampler's expand kernel leaves a float per-request value (each
request's temperature over its draft tokens) uninitialized; ours expands it. Then vLLM's own
rejection sampler on those kernels gives the target's distribution at temperature 0.7. The
acceptance job's run at temperatures 0 and 0.7 (tests/evaluation/test_acceptance_job.py)
checks the outputs: greedy ones with the draft equal the target's own in the same passes as
sampled ones (they did not: 5 of 8 before this fix, the others ending in token 0)."""

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


def test_sampled_rejection_on_vllms_cpu_kernels_with_the_fix_gives_the_targets_distribution():
    """Sampled speculative decoding on vLLM's CPU kernels (installed as its CPU model runner
    installs them), run through vLLM's own rejection sampler: 20,000 requests at temperature
    0.7, each with one draft token that is always token 0 (an EAGLE draft gives no draft
    probabilities). The first token out must follow the target's distribution whatever the
    draft proposes (rejection sampling is exact): with the fix, each share within 0.015 of the
    target's (over 4 standard errors). (vLLM's kernels alone gave the draft's token every time
    in a run by hand: its temperatures are whatever memory held, which no test can pin down;
    the test above shows them left unwritten.)"""
    import numpy as np
    import torch
    import vllm.utils.cpu_triton_utils as cpu_tl
    import vllm.v1.sample.rejection_sampler as rejection_sampler
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    from eagle_data.job.stages.engines import cpu_spec_decode

    cpu_spec_decode._install()
    requests, temperature = 20_000, 0.7
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    target = torch.softmax(logits / temperature, -1).numpy()
    metadata = SamplingMetadata(
        temperature=torch.full((requests,), temperature), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(requests), presence_penalties=torch.zeros(requests),
        repetition_penalties=torch.ones(requests), output_token_ids=[[] for _ in range(requests)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    cu_num_draft_tokens = torch.arange(1, requests + 1, dtype=torch.int32)

    kernels = ("rejection_greedy_sample_kernel", "rejection_random_sample_kernel", "expand_kernel",
               "sample_recovered_tokens_kernel")
    saved = {name: getattr(rejection_sampler, name) for name in kernels}
    try:
        for name in kernels:  # what vLLM's CPU model runner installs (cpu_model_runner._postprocess_triton)
            setattr(rejection_sampler, name, getattr(cpu_tl, name))
        torch.manual_seed(0)  # the uniform draws (no per-request generators)
        processed = rejection_sampler.apply_sampling_constraints(logits.repeat(requests, 1).contiguous(),
                                                                 cu_num_draft_tokens, metadata)
        out = rejection_sampler.rejection_sample(
            torch.zeros(requests, dtype=torch.int32), [1] * requests, 1, cu_num_draft_tokens, None, processed,
            torch.full((requests, 1), 4, dtype=torch.int32), metadata)
    finally:
        for name, kernel in saved.items():
            setattr(rejection_sampler, name, kernel)
    ours = np.bincount(out[:, 0].numpy(), minlength=5)[:5] / requests
    assert np.abs(ours - target).max() < 0.015, (ours, target)
