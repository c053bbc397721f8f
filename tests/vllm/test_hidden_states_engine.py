"""The hidden-states engine stage run for real (vLLM's CPU build, through Ray's vLLM stage)
on a 4-layer tiny Qwen3, against transformers in float32: one engine run per dtype.

The rows share prefixes and cross several 32-token blocks (vLLM's CPU attention takes multiples of 32), with prefix caching on and
prefill chunks of 32 tokens, so the files also cover cache hits and chunked prefill."""

from __future__ import annotations

import random

import pytest

from support import as_config, build_tiny_model, job_settings

pytestmark = pytest.mark.vllm

LAYERS = 4
LAYER_IDS = [1, 2, LAYERS]  # id L: the last layer's output before the final norm
ENGINE = dict(engine__backend="vllm", engine__device="cpu", engine__num_cpus=1, engine__cpu_kv_cache_gib=0.25,
              engine__batch_size=4, engine__max_concurrent_batches=4, engine__resource_wait_s=30,
              engine__engine_kwargs={"enforce_eager": True, "max_num_seqs": 8, "enable_prefix_caching": True,
                                     "block_size": 32, "max_num_batched_tokens": 32})
# dtype: (largest relative difference per row and layer, smallest cosine per token and layer)
TOLERANCE = {"float32": (1e-4, 0.99999), "bfloat16": (3e-2, 0.999)}


@pytest.fixture(scope="module")
def model(tmp_path_factory, qwen3_tokenizer_dir):
    return build_tiny_model(qwen3_tokenizer_dir, tmp_path_factory.mktemp("model") / "tiny-qwen3-l4-h64",
                            head_dim=64, layers=LAYERS)


def token_rows() -> list[list[int]]:
    rng = random.Random(0)

    def tokens(n):
        return [rng.randrange(1000, 100_000) for _ in range(n)]

    a, b = tokens(70), tokens(40)  # shared prefixes: 2 blocks and a bit, 1 block and a bit
    return [a + tokens(5), a + tokens(30), a + tokens(60), a, a[:40] + tokens(9), b + tokens(1), b + tokens(45),
            tokens(7)]


@pytest.fixture(scope="module")
def reference(model):
    """Transformers in float32: hidden_states[k] for k < L; for L the last decoder layer's output."""
    import torch
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
    last = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda module, args, out: last.update(out=out[0] if isinstance(out, tuple) else out))
    refs = []
    with torch.no_grad():
        for ids in token_rows():
            states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
            refs.append(torch.stack([last["out"][0] if k == LAYERS else states[k][0] for k in LAYER_IDS], dim=1))
    hook.remove()
    return refs


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hidden_states_files_match_transformers(ray_local, tmp_path, model, reference, dtype):
    import torch
    from safetensors.torch import load_file

    from eagle_data.job.stages.engines.vllm_hidden_states import vllm_hidden_states_stage, wait_for_file

    cfg = as_config(job_settings(tmp_path / "out", model, **ENGINE))
    rows = [{"sample_id": f"s{i}", "input_ids": ids, "source": f"src{i % 2}",
             "hidden_states_path": str(tmp_path / "hs" / "not-yet" / f"s{i}.safetensors")}
            for i, ids in enumerate(token_rows())]
    ds = ray_local.data.from_items(rows)
    out = vllm_hidden_states_stage(ds, cfg, LAYER_IDS, dtype, str(tmp_path / "scratch")).take_all()

    assert sorted(r["sample_id"] for r in out) == [r["sample_id"] for r in rows]
    assert set(out[0]) == {"sample_id", "input_ids", "hidden_states_path", "source", "__inference_error__"}
    by_id = {r["sample_id"]: r for r in rows}
    max_rel, min_cos = 0.0, 1.0
    for row in out:
        assert row["__inference_error__"] == ""
        sent = by_id[row["sample_id"]]
        assert row["hidden_states_path"] == sent["hidden_states_path"] and row["source"] == sent["source"]
        assert list(row["input_ids"]) == sent["input_ids"]
        wait_for_file(row["hidden_states_path"])
        data = load_file(row["hidden_states_path"])
        assert data["token_ids"].tolist() == sent["input_ids"]
        got = data["hidden_states"]
        assert got.dtype == getattr(torch, dtype)
        want = reference[int(row["sample_id"][1:])]
        assert got.shape == want.shape == (len(sent["input_ids"]), len(LAYER_IDS), 64)
        got = got.float()
        rel = ((got - want).norm(dim=(0, 2)) / want.norm(dim=(0, 2))).max().item()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
        max_rel, min_cos = max(max_rel, rel), min(min_cos, cos)
    print(f"{dtype}: largest relative difference {max_rel:.3g}, smallest cosine {min_cos:.7f}")
    rel_tol, cos_tol = TOLERANCE[dtype]
    assert max_rel <= rel_tol and min_cos >= cos_tol, (max_rel, min_cos)
